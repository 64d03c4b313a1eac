"""The sharded train step on 8 host devices against the same step on 1 device; prints one JSON line.

Run by tests/test_train_step.py in a subprocess, because the device count must be fixed before
jax is imported:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/sharded_step_check.py

Both runs use the same config, seed and batches; only the mesh differs (1x1 on the first device,
data=4 x fsdp=2 on all eight), with two micro-batches per step so the accumulation scan runs
sharded too. `--model llama_tiny` runs that family's tiny model instead, on 1 device and on
data 2 x fsdp 2 x tensor 2 only (tests/test_llama.py). `--orthogonal` runs Muon, NorMuon and Dion
on 1 device, fsdp 8 and tensor 2 x fsdp 4 (tests/test_sharded_orthogonalisation.py). `--moe` runs
the MoE cases (MOE_CASES, tests/test_moe.py) with GPT's tiny model, `--moe --model llama_tiny` with Llama's.

Time: nearly all of it is XLA compiling (per optimizer ~6 s for the sharded init, ~12 s for the
sharded step, CPU time, at LLVM's default level; half at level 0, used here, see below), which runs
in C++ without the GIL. So two worker threads build and compile every optimizer's 8-device golden
run while the main thread runs the 1- and 8-device comparison; the workers only initialise and
compile: every sharded step (the programs with collectives) executes in the main thread, one at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# What is compared is what XLA's SPMD partitioner makes of the step (an HLO-level rewrite); LLVM's
# optimisation of the CPU kernels it then emits does not change it, and at level 0 every compile
# here takes about half the time. (Measured: 1- vs 8-device and golden losses agree as closely as
# at the default level, <= 2e-5 relative against tolerances of 1e-5 on the first and 2e-4 on the rest.)
# And the classic CPU emitters, unsplit: under half the compile time again (tests/helpers.py SUITE_XLA_FLAGS).
os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1").strip()

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from optimizer import OPTIMIZERS
from utils.config import validate
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers import EPS32, compose_config
from test_golden import GOLDEN, GOLDEN_EXTRA
from test_golden import STEPS as GOLDEN_STEPS

LR, ADAM_EPS = 1e-2, 1e-3
OVERRIDES = [
    "model.dim=32", "model.num_heads=2", "model.num_blocks=2", "model.context_length=16", "model.vocab_size=64",
    "dataset.batch_size=8", "dataset.total_batch_size=16",
    "optimizer=adamw", "optimizer/lr_config=constant", f"optimizer.lr_config.lr={LR}", "optimizer.lr_config.warmup=0",
    # Adam's g/(|g|+eps) turns summation-order noise in a near-zero gradient entry into an O(lr)
    # parameter difference (measured: gradients agree to ~1e-8, yet with eps=1e-8 params differ by
    # ~1e-5 after 3 steps). eps=1e-3 keeps the comparison well conditioned, same code path.
    f"optimizer.eps={ADAM_EPS}",
    "train.gradient_clip_val=1.0",
]
STEPS, ACCUM, BATCH, WINDOW = 3, 2, 8, 17
# How far the parameters after STEPS steps may differ between meshes, which only reorder float32 sums.
# A gradient entry sums ACCUM·BATCH·(WINDOW-1) = 256 tokens' terms: ~√256·EPS32 of their scale, which
# after the clip at global norm 1 is ~1/√(#params) ≈ 6e-3 (~30k params), ~1e-8 even where they cancel
# to g ≈ 0, and Adam passes that on as <= lr·δg/eps (at g ≈ 0): over STEPS steps ~3.4e-7, 3x (PARAM_ATOL).
# And each step rounds p + Δp by <= EPS32/2 of p, on each side: STEPS·EPS32 of p, 3x (PARAM_RTOL).
GRAD_SCALE = 1 / math.sqrt(30_000)
PARAM_ATOL = 3 * STEPS * LR * math.sqrt(ACCUM * BATCH * (WINDOW - 1)) * EPS32 * GRAD_SCALE / ADAM_EPS
PARAM_RTOL = 3 * STEPS * EPS32


def params_allclose(a_list, b_list) -> bool:
    return all(np.allclose(b, a, rtol=PARAM_RTOL, atol=PARAM_ATOL) for a, b in zip(a_list, b_list, strict=True))


def build(parallel: tuple, devices, overrides=tuple(OVERRIDES)):
    """`parallel`: (data, fsdp[, tensor[, shard_optimizer_state]])."""
    data, fsdp, tensor, zero1 = (*parallel, 1, False)[:4] if len(parallel) == 2 else (*parallel, False)[:4]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        run = validate(compose("config", overrides=[*overrides, f"parallel.data={data}", f"parallel.fsdp={fsdp}",
                                                    f"parallel.tensor={tensor}",
                                                    f"parallel.shard_optimizer_state={str(zero1).lower()}"]))
    p = run.parallel
    mesh = meshlib.make_mesh(p.data, p.fsdp, run.dataset.batch_size, devices=devices, tensor=p.tensor,
                             expert=p.expert)  # parallel.expert: from `overrides` (--moe)
    _, _, state, step = T.init_training(run, mesh)
    return state, jax.tree.map(lambda x: x.sharding, state), step, mesh  # shardings as initialised


def arrays(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def is_split(x: jax.Array) -> bool:
    return tuple(x.sharding.shard_shape(x.shape)) != tuple(x.shape)


def tensor_split_stats(opt_state) -> int:
    """Leaves of Shampoo-style statistics (a `*_stats`/`*_roots` field) split over the tensor axis."""
    count = 0
    for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
        names = jax.tree_util.keystr(path)
        if isinstance(x, jax.Array) and ("stats" in names or "roots" in names) and is_split(x):
            count += "tensor" in str(x.sharding.spec)
    return count


def train(parallel, devices, batches_SxAxBxT1, overrides=tuple(OVERRIDES), after_step=None):
    """`after_step(i, state)` sees the state after step i, before the next step donates it."""
    state, shardings, step, mesh = build(parallel, devices, overrides)
    info = {
        "mesh": dict(mesh.shape),
        **layout_info(state),
        "sharded_param_leaves": sum(map(is_split, arrays(state.model))),
        "sharded_opt_leaves": sum(map(is_split, arrays(state.opt_state))),
    }
    init = [np.array(x) for x in arrays(state.model)]
    sharding = meshlib.batch_sharding(mesh, 1)
    losses = []
    for i, batch in enumerate(batches_SxAxBxT1, start=1):
        placed = meshlib.put_batch(batch, sharding)
        info["batch_shard_rows"] = placed.sharding.shard_shape(placed.shape)[1]
        state, metrics = step(state, placed)
        losses.append(float(metrics["train/loss"]))
        if after_step is not None:
            after_step(i, state)
    info["state_shardings_kept"] = all(
        x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True))
    final = [np.array(x) for x in arrays(state.model)]
    info["params_moved"] = max(float(np.abs(a - b).max()) for a, b in zip(final, init))
    return losses, final, info


def layout_info(state) -> dict:
    """Where the layout rules put the embedding, the blocks' matrices and Adam's moments of them
    (utils/parallel/layout.py): GPT's by the names test_train_step.py reads; another family's
    (`--model`) every block matrix by its field name."""
    spec = lambda leaf: [str(a) for a in leaf.sharding.spec]
    model = state.model
    if getattr(getattr(model.cfg, "moe", None), "on", False):  # --moe: the experts' and the router's layout
        moe = model.blocks.moe if hasattr(model.blocks, "dense") else model.blocks
        experts = [getattr(moe.moe.experts, f.name) for f in dataclasses.fields(moe.moe.experts)]  # first in, last out
        return {"specs": {"experts_in": spec(experts[0].weight_IxO), "experts_out": spec(experts[-1].weight_IxO),
                          "router": spec(moe.moe.router.weight_IxO)}}
    if not hasattr(model, "wte_VxD"):
        linears = {f.name: getattr(model.blocks, f.name) for f in dataclasses.fields(model.blocks)}
        return {"specs": {name: spec(m.weight_IxO) for name, m in linears.items() if hasattr(m, "weight_IxO")}}
    return {
        "wte_shape": list(model.wte_VxD.shape),
        "wte_devices": len(model.wte_VxD.sharding.device_set),
        "wte_shard_shape": list(model.wte_VxD.sharding.shard_shape(model.wte_VxD.shape)),
        "specs": {name: spec(leaf) for name, leaf in (
            ("qkv", model.blocks.attn_qkv.weight_IxO), ("attn_out", model.blocks.attn_out.weight_IxO),
            ("mlp_in", model.blocks.mlp_in.weight_IxO), ("mlp_out", model.blocks.mlp_out.weight_IxO),
            ("mu_mlp_in", adam_moment(state.opt_state).blocks.mlp_in.weight_IxO))},
    }


# `--model NAME`: another family's tiny config instead of GPT's, with what it needs on top of OVERRIDES
# (llama_tiny: 4 query heads on 2 key/value heads, so grouped-query attention is what tensor splits).
MODEL_OVERRIDES = {"llama_tiny": ("model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2")}


def model_check(name: str) -> dict:
    """`--model NAME`: that model's 3 steps on 1 device and on data 2 x fsdp 2 x tensor 2 (8 devices)."""
    devices = jax.devices()
    batches = np.random.default_rng(0).integers(0, 64, (STEPS, ACCUM, BATCH, WINDOW), dtype=np.int32)
    overrides = (*OVERRIDES, *MODEL_OVERRIDES[name])
    losses_1, params_1, info_1 = train((1, 1), devices[:1], batches, overrides)
    losses_tp, params_tp, info_tp = train((2, 2, 2), devices, batches, overrides)
    return {"devices": len(devices), "mesh": info_tp["mesh"], "losses_1": losses_1, "losses_tp": losses_tp,
            "params_moved": info_1["params_moved"], "specs": info_tp["specs"], "kept": info_tp["state_shardings_kept"],
            "sharded_param_leaves": info_tp["sharded_param_leaves"],
            "max_param_diff": max(float(np.abs(a - b).max()) for a, b in zip(params_1, params_tp, strict=True)),
            "params_allclose": params_allclose(params_1, params_tp)}


def zero1_and_cross_topology(devices, batches_SxAxBxT1, directory: str):
    """ZeRO-1 (data 8, optimizer state split over data) trains like the others and saves after
    step 2; data 4 x fsdp 2 restores that checkpoint (the state now split over fsdp): the restored
    arrays equal the saved ones and its step 3 has the loss ZeRO-1's step 3 had."""
    import dataclasses

    from trainer.resume import resume_source
    from utils.checkpoint.storage import Checkpointer

    ck = ["checkpoint.save=true", f"checkpoint.save_path={directory}", "checkpoint.resume=auto",
          "checkpoint.async_save=false"]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        run_b = validate(compose("config", overrides=[*OVERRIDES, *ck, "parallel.data=4", "parallel.fsdp=2"]))
    saved = []

    def save_after_2(i, state):
        if i == 2:
            saver = Checkpointer(run_b.checkpoint, run_b.config_dict, dataclasses.asdict(run_b.model), print)
            saver.save(2, state, {}, {}, "test")
            saver.close()
            saved.extend(np.array(x) for x in arrays((state.model, state.opt_state)))

    z1 = train((8, 1, 1, True), devices, batches_SxAxBxT1, (*OVERRIDES, *ck), after_step=save_after_2)
    mesh_b = meshlib.make_mesh(4, 2, run_b.dataset.batch_size, devices=devices)
    _, _, restored, step_b = T.init_training(run_b, mesh_b, resume_source(run_b.checkpoint, print))
    out = {"restored_equal": all(np.array_equal(a, np.array(b))
                                 for a, b in zip(saved, arrays((restored.model, restored.opt_state)), strict=True)),
           "restored_step": int(restored.step),
           "restored_opt_split_over": sorted({str(a) for x in arrays(restored.opt_state) for a in x.sharding.spec
                                              if a is not None})}
    _, after = step_b(restored, meshlib.put_batch(batches_SxAxBxT1[2], meshlib.batch_sharding(mesh_b, 1)))
    return z1, {**out, "loss_saving_mesh": z1[0][2], "loss_restoring_mesh": float(after["train/loss"])}


def adam_moment(opt_state):
    """The hidden group's first moment (AdamW's and Muon's `mu`, Dion's `momentum`): a tree shaped like
    the model, other groups masked."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu") or hasattr(x, "momentum")):
        moment = getattr(leaf, "mu", getattr(leaf, "momentum", None))
        if moment is not None and isinstance(moment.blocks.mlp_in.weight_IxO, jax.Array):
            return moment
    raise AssertionError("no first-moment state in the chain")


def golden_config(optimizer: str):
    """tests/test_golden.py's golden_run config for `optimizer`, composed in the main thread (Hydra's
    compose API is not thread-safe). A copy: should it drift from golden_run, the losses below stop
    matching GOLDEN and the test fails; it cannot pass by it."""
    lr = {"sgdm": 0.3, "lion": 3e-3}.get(optimizer)
    return validate(compose_config(f"optimizer={optimizer}", "train.max_steps=30", "optimizer.lr_config.warmup=5",
                                   *([f"optimizer.lr_config.lr={lr}"] if lr else []), *GOLDEN_EXTRA.get(optimizer, ())))


def prepare_golden(run, devices):
    """golden_run's state, step and fixed batch on data=2 x fsdp=2 x tensor=2 (every optimizer's
    state laid out by all three rules), the step compiled but not run (a worker thread: XLA
    compiles without the GIL)."""
    mesh = meshlib.make_mesh(2, 2, run.dataset.batch_size, devices=devices, tensor=2)
    _, _, state, step = T.init_training(run, mesh)
    batch_1xBxT1 = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch = meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))
    step.logging.lower(state, batch, step.args).compile()  # what step(state, batch) runs: the logging variant
    return state, step, batch


def run_golden(state, step, batch) -> tuple[list[float], object]:
    """golden_run's steps (main thread): the logged losses of steps 1..GOLDEN_STEPS and of the weights after."""
    losses = []
    for _ in range(GOLDEN_STEPS + 1):
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    return losses, state


# `--moe`: GPT's tiny config with 4 experts, top-2: (overrides, mesh (data, fsdp, tensor)) per case; the
# expert axis comes from the overrides. Capacity routing (slots dropped) on data 2 x expert 2 x fsdp 2;
# dropless (ragged_dot) with every second block MoE on expert 2 x fsdp 2 x tensor 2.
MOE_CASES = {
    "capacity": (("model.moe.num_experts=4", "model.moe.capacity_factor=1.0", "parallel.expert=2"), (2, 2, 1)),
    "dropless": (("model.moe.num_experts=4", "model.moe.every=2", "parallel.expert=2"), (1, 2, 2)),
}


def moe_check(model: str | None = None) -> dict:
    """`--moe`: each MOE_CASES case's 3 steps on 1 device and on its 8-device mesh (`--moe --model NAME`:
    that family's tiny model, MODEL_OVERRIDES, with the same experts)."""
    devices = jax.devices()
    batches = np.random.default_rng(0).integers(0, 64, (STEPS, ACCUM, BATCH, WINDOW), dtype=np.int32)
    base = (*OVERRIDES, *MODEL_OVERRIDES.get(model, ()))
    out = {"devices": len(devices)}
    for name, (extra, parallel) in MOE_CASES.items():
        one = tuple(o for o in extra if not o.startswith("parallel."))
        losses_1, params_1, info_1 = train((1, 1), devices[:1], batches, (*base, *one))
        losses_8, params_8, info_8 = train(parallel, devices, batches, (*base, *extra))
        out[name] = {"mesh": info_8["mesh"], "losses_1": losses_1, "losses_8": losses_8, "specs": info_8["specs"],
                     "kept": info_8["state_shardings_kept"], "params_moved": info_1["params_moved"],
                     "max_param_diff": max(float(np.abs(a - b).max()) for a, b in zip(params_1, params_8, strict=True)),
                     "params_allclose": params_allclose(params_1, params_8)}
    return out


# `--orthogonal`: the optimizers that orthogonalise whole hidden matrices (Newton–Schulz, Dion's QR),
# whose update is not elementwise: each block's update depends on the whole block, so a block split over
# devices must be gathered (or orthogonalised by a distributed method) to give the unsharded update.
# Each runs STEPS steps on 1 device, on fsdp 8 and on tensor 2 x fsdp 4, every hidden matrix split.
ORTHOGONAL_OPTIMIZERS = ("muon", "normuon", "dion")
ORTHOGONAL_MESHES = {"fsdp8": (1, 8, 1), "tensor2_fsdp4": (1, 4, 2)}


def orthogonal_overrides(name: str) -> tuple[str, ...]:
    """OVERRIDES for `name`: its AdamW groups' eps (adam_eps) at ADAM_EPS, as AdamW's is there."""
    swap = {"optimizer=adamw": f"optimizer={name}", f"optimizer.eps={ADAM_EPS}": f"optimizer.adam_eps={ADAM_EPS}"}
    return tuple(swap.get(o, o) for o in OVERRIDES)


def hidden_state_split(opt_state, model) -> int:
    """The optimizer-state leaves shaped like a block matrix (momentum, buffers) that are split."""
    shapes = {tuple(x.shape) for x in arrays(model) if x.ndim == 3}
    return sum(is_split(x) for x in arrays(opt_state) if tuple(x.shape) in shapes)


def orthogonal_check() -> dict:
    devices = jax.devices()
    batches = np.random.default_rng(0).integers(0, 64, (STEPS, ACCUM, BATCH, WINDOW), dtype=np.int32)
    out = {"devices": len(devices)}
    for name in ORTHOGONAL_OPTIMIZERS:
        overrides = orthogonal_overrides(name)
        losses_1, params_1, info_1 = train((1, 1), devices[:1], batches, overrides)
        row = {"losses_1": losses_1, "params_moved": info_1["params_moved"]}
        for mesh_name, parallel in ORTHOGONAL_MESHES.items():
            split = []
            count_split = lambda i, s, keep=split: keep.append(hidden_state_split(s.opt_state, s.model))
            losses, params, info = train(parallel, devices, batches, overrides, after_step=count_split)
            row[mesh_name] = {"mesh": info["mesh"], "losses": losses, "specs": info["specs"],
                              "kept": info["state_shardings_kept"], "hidden_state_split": split[0],
                              "sharded_param_leaves": info["sharded_param_leaves"],
                              "diffs": [float(np.abs(a - b).max()) for a, b in zip(params_1, params, strict=True)],
                              "scales": [float(np.abs(a).max()) for a in params_1]}
        out[name] = row
    return out


def main() -> None:
    if "--orthogonal" in sys.argv:
        print(json.dumps(orthogonal_check()))
        return
    if "--moe" in sys.argv:
        print(json.dumps(moe_check(sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else None)))
        return
    if "--model" in sys.argv:
        print(json.dumps(model_check(sys.argv[sys.argv.index("--model") + 1])))
        return
    devices = jax.devices()
    rng = np.random.default_rng(0)
    batches = rng.integers(0, 64, (STEPS, ACCUM, BATCH, WINDOW), dtype=np.int32)

    names = sorted(OPTIMIZERS, key=lambda n: n != "shampoo")  # the slowest compile first
    configs = {name: golden_config(name) for name in names}
    with ThreadPoolExecutor(2) as pool:
        prepared = {name: pool.submit(prepare_golden, configs[name], devices) for name in names}
        losses_1, params_1, info_1 = train((1, 1), devices[:1], batches)
        losses_8, params_8, info_8 = train((4, 2), devices, batches)
        # Tensor parallelism (heads and MLP columns over 2 devices) and ZeRO-1 (optimizer state over data=8).
        losses_tp, params_tp, info_tp = train((2, 2, 2), devices, batches)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            (losses_z1, params_z1, info_z1), restore = zero1_and_cross_topology(devices, batches,
                                                                                os.path.join(tmp, "ck"))
        # Every registered optimizer runs sharded (data 2 x fsdp 2 x tensor 2) and matches its 1-device
        # losses: the golden values of tests/test_golden.py, which pins them for the same run on one device.
        golden = {name: run_golden(*prepared[name].result()) for name in sorted(OPTIMIZERS)}
    assert info_1["sharded_param_leaves"] == 0

    result = {
        "devices": len(devices),
        **info_8,
        "losses_1": losses_1,
        "losses_8": losses_8,
        "params_moved": info_1["params_moved"],
        "max_param_diff": max(float(np.abs(a - b).max()) for a, b in zip(params_1, params_8, strict=True)),
        "params_allclose": params_allclose(params_1, params_8),
    }
    result["tensor"] = {"losses": losses_tp, "specs": info_tp["specs"], "kept": info_tp["state_shardings_kept"],
                        "params_allclose": params_allclose(params_1, params_tp)}
    result["zero1"] = {"losses": losses_z1, "specs": info_z1["specs"], "kept": info_z1["state_shardings_kept"],
                       "sharded_param_leaves": info_z1["sharded_param_leaves"],
                       "sharded_opt_leaves": info_z1["sharded_opt_leaves"],
                       "params_allclose": params_allclose(params_1, params_z1)}
    result["cross_topology"] = restore
    result["optimizers"] = {name: {"losses_1": GOLDEN[name], "losses_8": losses_8,
                                   "sharded_opt_leaves": sum(map(is_split, arrays(state.opt_state))),
                                   "tensor_split_stats": tensor_split_stats(state.opt_state)}
                            for name, (losses_8, state) in golden.items()}
    for name, args in (("bad_batch_error", (-1, 1, 12)), ("bad_mesh_error", (3, 2, 8))):
        try:
            meshlib.make_mesh(*args)
            result[name] = ""
        except ConfigError as e:
            result[name] = str(e)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
