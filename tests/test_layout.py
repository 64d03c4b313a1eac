"""Where utils/parallel/layout.py puts each array of the train state, checked on abstract meshes (no
devices needed): tensor parallelism by the model's named axes, FSDP on the largest free axis,
ZeRO-1 on the optimizer state only, and every optimizer's state following its parameters.
The numbers (sharded losses equal one device's) are checked on 8 devices by sharded_step_check.py."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import models
import train_jax as T
from models.gpt import GPT, param_axes
from optimizer import OPTIMIZERS
from trainer import aux_state
from trainer.step import TrainState
from utils.errors import ConfigError
from utils.parallel import layout
from utils.parallel.mesh import make_mesh


def _abstract_state(run, tx):
    def build():
        model_key, key = jax.random.split(jax.random.PRNGKey(0))
        model = T.init_model(run, model_key)
        return TrainState(model, tx.init(eqx.filter(model, eqx.is_array)), jax.numpy.zeros((), "int32"), key,
                          {"aux": aux_state.init(run.logging.aux, eqx.filter(model, eqx.is_inexact_array))})

    return jax.eval_shape(build)


def _specs(tree, shardings):
    return {".".join(layout._names(p)): tuple(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(shardings)}


def _layout(tiny_run, optimizer, data=2, fsdp=2, tensor=2, zero1=False, *overrides):
    run = tiny_run(f"optimizer={optimizer}", "logging.log_callback_data=true", "model.num_heads=4", *overrides)
    labels = models.param_labels(eqx.filter_eval_shape(GPT, run.model, jax.random.PRNGKey(0)))
    tx = T.init_optimizer(run, T.init_scheduler(run), labels)
    abstract = _abstract_state(run, tx)
    mesh = AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))
    shardings = layout.state_shardings(mesh, abstract, abstract.model, param_axes(abstract.model), zero1=zero1)
    return abstract, _specs(abstract, shardings)


def test_tensor_parallel_splits_heads_and_mlp_columns_then_rows(tiny_run):
    _, specs = _layout(tiny_run, "adamw")
    # (blocks, d_in, d_out): qkv and mlp_in column-parallel, attn_out and mlp_out row-parallel;
    # FSDP takes the largest dimension left.
    assert specs["model.blocks.attn_qkv.weight_IxO"] == (None, "fsdp", "tensor")
    assert specs["model.blocks.mlp_in.weight_IxO"] == (None, "fsdp", "tensor")
    assert specs["model.blocks.attn_out.weight_IxO"] == (None, "tensor", "fsdp")
    assert specs["model.blocks.mlp_out.weight_IxO"] == (None, "tensor", "fsdp")
    assert specs["model.blocks.mlp_in.bias_O"] == (None, "tensor")
    assert "tensor" not in specs["model.wte_VxD"]


def test_the_qkv_columns_split_into_whole_heads():
    """Head-major storage: a contiguous half of the fused columns is exactly heads 0..H/2-1 of q,
    k and v, each column the one the (q|k|v, head, K) order had there."""
    from models.gpt import _head_major
    from models.layers import Linear

    D, H, K = 4, 4, 2
    w_DxO = np.arange(D * 3 * H * K, dtype=np.float32).reshape(D, 3 * H * K)  # column c of row 0 = c
    hm = np.asarray(_head_major(Linear(jax.numpy.asarray(w_DxO), jax.numpy.asarray(w_DxO[0])), H).weight_IxO)
    as_DxHx3xK = hm.reshape(D, H, 3, K)
    for h in range(H):
        for qkv in range(3):
            np.testing.assert_array_equal(as_DxHx3xK[:, h, qkv], w_DxO.reshape(D, 3, H, K)[:, qkv, h])
    first_half = hm[:, : hm.shape[1] // 2].reshape(D, H // 2, 3, K)
    np.testing.assert_array_equal(first_half, as_DxHx3xK[:, : H // 2])


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizers_state_follows_its_parameters_and_zero1_splits_only_it(tiny_run, optimizer):
    abstract, specs = _layout(tiny_run, optimizer, data=2, fsdp=1, tensor=2, zero1=True)
    shapes = {".".join(layout._names(p)): x.shape for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    params = {k: v for k, v in specs.items() if k.startswith("model.")}
    mlp_in_shape = shapes["model.blocks.mlp_in.weight_IxO"]
    assert not any("data" in np.atleast_1d(a) for spec in params.values() for a in spec if a)  # replicated on data
    for name, spec in specs.items():
        if not name.startswith("opt_state."):
            continue
        for param_name in params:
            # A moment shaped like mlp_in (Adam's mu/nu, Muon's momentum, Lion's, SGD's trace) is split
            # like mlp_in over tensor, and over data too (ZeRO-1).
            if (name.endswith(param_name[len("model."):]) and "mlp_in.weight_IxO" in name
                    and shapes[name] == mlp_in_shape):  # not Adafactor's factored row/column statistics
                assert spec[2] == "tensor", (name, spec)
                assert "data" in [a for s in spec if s for a in np.atleast_1d(s)], (name, spec)
    opt_split = sum(1 for n, s in specs.items() if n.startswith("opt_state.") and any(s))
    assert opt_split > 0
    # the aux-state buffers are laid out like the parameters
    buffers = {n: s for n, s in specs.items() if n.startswith("metric_states.aux.") and n.endswith("mlp_in.weight_IxO")}
    assert len(buffers) == 3, sorted(specs)  # x(n-1), g(n-1), sum g(1..n-1)
    for name, spec in buffers.items():
        assert spec == params["model.blocks.mlp_in.weight_IxO"], name


def _per_device_share(shape, spec, mesh_shape) -> float:
    parts = [a for entry in spec if entry for a in np.atleast_1d(entry)]
    return 1 / float(np.prod([mesh_shape[a] for a in parts])) if parts else 1.0


def test_derived_statistics_split_like_their_parameter(tiny_run):
    """Shampoo's blocked statistics (*stack, R, C, b, b) split their block grid as the parameter
    splits its rows and columns; when the grid cannot split (one block), the model axes go to the
    block's own sides, never to the stacked-blocks axis. Adafactor's factored row and column
    statistics keep the split of the dimension they keep. Either way each device holds
    1/(fsdp·tensor) of the statistics, as it does of the parameter."""
    mesh_shape = {"data": 1, "fsdp": 2, "tensor": 2}

    def opt_leaves(specs, shapes, field, param):
        found = {n: (shapes[n], specs[n]) for n in specs
                 if n.startswith("opt_state.") and f".{field}." in f".{n}." and n.endswith(param)}
        assert found, (field, param, sorted(specs))
        return list(found.values())

    for block_size, grid_split in ((16, True), (256, False)):
        abstract, specs = _layout(tiny_run, "shampoo", 1, 2, 2, False, f"optimizer.block_size={block_size}")
        shapes = {".".join(layout._names(p)): x.shape for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
        assert specs["model.blocks.mlp_in.weight_IxO"] == (None, "fsdp", "tensor")  # (2, 32, 128)
        for field in ("left_stats", "right_stats", "left_roots", "right_roots"):
            [(shape, spec)] = opt_leaves(specs, shapes, field, "blocks.mlp_in.weight_IxO")
            b = min(block_size, 32 if field.startswith("left") else 128)
            assert shape == (2, -(-32 // min(block_size, 32)), -(-128 // min(block_size, 128)), b, b)
            spec = tuple(spec) + (None,) * (len(shape) - len(spec))
            if grid_split:  # a 2 x 8 grid of 16 x 16 blocks: rows over fsdp, columns over tensor
                assert spec == (None, "fsdp", "tensor", None, None), (field, spec)
            else:  # one block: its sides take the model axes
                assert spec[:3] == (None, None, None) and {spec[3], spec[4]} == {"fsdp", "tensor"}, (field, spec)
            assert _per_device_share(shape, spec, mesh_shape) == 1 / 4

    # Adafactor factors sides of 128 and more: dim 128, so mlp_in is (2, 128, 512), split (-, fsdp, tensor).
    abstract, specs = _layout(tiny_run, "adafactor", 1, 2, 2, False, "model.dim=128")
    shapes = {".".join(layout._names(p)): x.shape for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    factored = {shapes[n]: tuple(specs[n]) for n in specs
                if n.startswith("opt_state.") and n.endswith("blocks.mlp_in.weight_IxO")
                and shapes[n] not in ((1,), (2, 128, 512))}
    # The rows' statistics (2, 128) keep fsdp, the columns' (2, 512) tensor.
    assert factored == {(2, 128): (None, "fsdp"), (2, 512): (None, "tensor")}, factored


def test_mesh_knobs_are_checked_before_anything_compiles(tiny_run):
    with pytest.raises(ConfigError, match="parallel.tensor"):
        make_mesh(-1, 1, 8, devices=jax.devices()[:1] * 1, tensor=3)
    with pytest.raises(ConfigError, match="parallel.distributed"):
        tiny_run("parallel.distributed=sometimes")
    assert tiny_run("parallel.distributed=false").parallel.distributed is False  # YAML's bool, read as "false"
