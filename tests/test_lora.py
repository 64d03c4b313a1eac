"""LoRA fine-tuning (models/lora.py, `model.lora.*`): rank 0 is today's model; fresh factors compute
the base; a step moves the factors alone and the optimizer keeps no state for the frozen base; the
merged model (and its `--merge-lora` export) computes the unmerged one's logits; a LoRA run on
dataset=chat learns; a resumed LoRA run is bit-identical; bad knobs are one line each."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, load_script, sum_atol
from safetensors.numpy import load_file

import models
import train_jax
from models import export, gpt, lora
from trainer import inference
from utils.checkpoint.storage import complete_steps
from utils.config import validate
from utils.errors import CheckpointError, ConfigError
from utils.parallel import mesh as meshlib

LORA = ("model.lora.rank=4", "model.lora.alpha=8")
TOKENS_BxT = np.random.default_rng(0).integers(0, 64, (2, 16), dtype=np.int32)
F32_EPS = float(np.finfo(np.float32).eps)


def arrays(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.array(x) for p, x in leaves}


def is_factor(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in lora.FACTORS


def with_random_b(model, key, std=0.05):
    """Fresh B factors are zero (the model is its base); tests that need the branch to matter draw them."""
    def fill(path, x):
        if jax.tree_util.keystr(path, simple=True, separator=".").endswith("lora_b_RxO"):
            return std * jax.random.normal(jax.random.fold_in(key, x.size), x.shape, x.dtype)
        return x
    return jax.tree_util.tree_map_with_path(fill, model)


# ----------------------------------------------------------------------------- the model


def test_rank_zero_is_todays_model(tiny_run):
    run = tiny_run()
    assert run.model.lora == lora.LoraConfig() and not run.model.lora.on
    model = models.build(run.model, jax.random.PRNGKey(0))
    plain = gpt.GPT(run.model, jax.random.PRNGKey(0))
    assert jax.tree.structure(model) == jax.tree.structure(plain) and not models.lora.has_factors(model)
    for (name, a), b in zip(arrays(model).items(), arrays(plain).values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert set(jax.tree.leaves(models.param_labels(model))) == {"hidden", "embed", "scalar"}
    assert models.train_loss(run.model, run.objective) is run.objective.loss_fn  # the same program


def test_fresh_factors_compute_exactly_the_base(tiny_run):
    """B = 0 at the start: logits equal the rank-0 model's bit for bit, and adding the factors drew
    nothing from the base's keys (every base array is the rank-0 model's)."""
    base_run, lora_run = tiny_run(), tiny_run(*LORA)
    base = models.build(base_run.model, jax.random.PRNGKey(3))
    tuned = models.build(lora_run.model, jax.random.PRNGKey(3))
    got = arrays(tuned)
    assert {n for n in got if is_factor(n)} == {f"blocks.{t}.{f}" for t in gpt.LORA_TARGETS for f in lora.FACTORS}
    assert got["blocks.attn_qkv.lora_a_IxR"].shape == (2, 32, 4) and got["blocks.attn_qkv.lora_b_RxO"].shape == (
        2, 4, 96)
    for name, x in arrays(base).items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    assert np.abs(got["blocks.mlp_in.lora_a_IxR"]).max() <= 1 / np.sqrt(32)  # Kaiming-uniform bound 1/sqrt(in)
    assert np.abs(got["blocks.mlp_out.lora_a_IxR"]).max() > 0.5 / np.sqrt(128)
    np.testing.assert_array_equal(np.asarray(tuned(TOKENS_BxT)), np.asarray(base(TOKENS_BxT)))


def test_targets_pick_the_projections(tiny_run):
    run = tiny_run(*LORA, "model.lora.targets=[attn_qkv,mlp_out]")
    names = {n for n in arrays(models.build(run.model, jax.random.PRNGKey(0))) if is_factor(n)}
    assert {n.split(".")[1] for n in names} == {"attn_qkv", "mlp_out"}


def test_merged_model_computes_the_unmerged_logits(tiny_run):
    """x·(W + s·A·B) against x·W + s·(x·A)·B, with B drawn so the branch moves the logits. The two
    differ by float32 rounding: each projection's output by ~eps·sqrt(K)·|x||W| (K <= 128 summands),
    carried through 2 blocks to logits of scale max|logits|; 64·eps·sqrt(128) relative to that scale
    (~1e-4) is well above that and far below what a wrong merge moves them (the branch moves them by
    > 1e-2 here: checked)."""
    run = tiny_run(*LORA)
    tuned = with_random_b(models.build(run.model, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
    merged = models.for_export(tuned, True, "safetensors")
    assert not lora.has_factors(merged) and merged.cfg.lora == lora.LoraConfig()
    assert jax.tree.structure(merged) == jax.tree.structure(models.build(tiny_run().model, jax.random.PRNGKey(0)))
    logits = eqx.filter_jit(lambda m, t: m(t))
    want, got = np.asarray(logits(tuned, TOKENS_BxT)), np.asarray(logits(merged, TOKENS_BxT))
    base = np.asarray(logits(models.build(tiny_run().model, jax.random.PRNGKey(0)), TOKENS_BxT))
    scale = np.abs(want).max()
    assert np.abs(want - base).max() > 1e-2 * scale  # the branch matters, so a wrong merge would show
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * F32_EPS * np.sqrt(128) * scale)


# ----------------------------------------------------------------------------- training


def assemble(run):
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    return train_jax.init_training(run, mesh)


def batch(run, seed):
    tokens = np.random.default_rng(seed).integers(0, 64, (1, run.dataset.batch_size, 17), dtype=np.int32)
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    return meshlib.put_batch(tokens, meshlib.batch_sharding(mesh, 1))


def test_a_lora_step_moves_only_the_factors(tiny_run):
    """Every base array bit-identical after two steps (with LoRA dropout on), both factors moved
    (B from its first step, A from its second: its gradient is B-shaped, zero at first), and the
    logged grad norm is the factors' gradient's (the base's gradients are exact zeros)."""
    run = tiny_run(*LORA, "model.lora.dropout=0.1", "optimizer.groups.lora.lr=1e-2",
                   "optimizer/lr_config=constant", "optimizer.lr_config.warmup=0")
    _, _, state, step = assemble(run)
    before = arrays(state.model)
    for i in range(2):
        state, metrics = step(state, batch(run, i), True)
    after = arrays(state.model)
    for name, x in before.items():
        if is_factor(name):
            assert np.abs(after[name] - x).max() > 0, f"{name} did not move"
        else:
            np.testing.assert_array_equal(after[name], x, err_msg=name)
    assert float(metrics["train/lr/lora"]) == pytest.approx(1e-2)
    assert {k for k in metrics if k.startswith("train/lr/")} == {"train/lr/lora"}  # no lr for a frozen group


def test_frozen_base_gets_zero_gradient_and_no_optimizer_state(tiny_run):
    run = tiny_run(*LORA)
    _, tx, state, _ = assemble(run)
    params = arrays(state.model)
    factor_shapes = sorted(x.shape for n, x in params.items() if is_factor(n))
    # AdamW keeps mu and nu per trained array; the rest of its state is step counts (scalars).
    opt_arrays = [x for x in jax.tree.leaves(state.opt_state) if hasattr(x, "shape")]
    assert sorted(x.shape for x in opt_arrays if x.ndim) == sorted(factor_shapes * 2)
    assert sum(x.size for x in opt_arrays if x.ndim) == 2 * sum(int(np.prod(s)) for s in factor_shapes)

    loss = models.train_loss(run.model, run.objective)
    grads = eqx.filter_grad(lambda m: loss(m, jnp.asarray(TOKENS_BxT[:, :17]), None, jnp.float32)[0])(
        with_random_b(state.model, jax.random.PRNGKey(2)))
    for name, g in arrays(grads).items():
        assert (np.abs(g).max() > 0) == is_factor(name), name


def test_the_aux_hook_keeps_no_buffers_for_the_frozen_base(tiny_run):
    """With LoRA the aux-state hook's three per-parameter buffers hold the factors alone (not three
    copies of the base), and every diagnostic it logs, the extra x(n-1) forward/backward's included,
    equals the hook keeping buffers for every array: the base's terms are exact zeros."""
    from trainer import aux_state

    run = tiny_run(*LORA, "logging.log_callback_data=true", "logging.compute_last_loss=true",
                   "logging.compute_last_grads=true", "logging.optim_diagnostics=false",
                   "optimizer.groups.lora.lr=1e-2", "optimizer/lr_config=constant", "optimizer.lr_config.warmup=0")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    labels = models.param_labels(models.abstract(run.model))
    schedule = train_jax.init_scheduler(run)
    results = []
    for hook_labels in (labels, None):
        metrics = [m for m in train_jax.default_metrics(run, schedule, labels) if m.name != "aux"]
        metrics.append(aux_state.AuxHook(run.logging.aux, hook_labels))
        _, _, state, step = train_jax.init_training(run, mesh, metrics=metrics)
        for i in range(3):
            state, out = step(state, batch(run, i), True)
        results.append((state.metric_states["aux"], {k: float(v) for k, v in out.items()}))
    (kept, logged), (full, want) = results
    for buffer in (kept.last_params, kept.last_grads, kept.past_grads):
        assert sorted(arrays(buffer)) == sorted(n for n in arrays(full.last_params) if is_factor(n))
    assert set(logged) == set(want) and any(k.startswith("update/") for k in logged)
    for name, value in want.items():  # the same terms summed, zeros left out: float32 rounding at most
        assert logged[name] == pytest.approx(value, rel=16 * F32_EPS, abs=16 * F32_EPS), name


def test_lora_flops_skip_the_bases_weight_gradients(tiny_run):
    """MFU's FLOPs with LoRA: the frozen matmuls cost 4 per weight (forward and input gradient, no weight
    gradient), each factor value 6; the attention term stays. Counted by hand for the tiny GPT."""
    run = tiny_run(*LORA)
    d, L, T, V, r = 32, 2, 16, run.model.vocab_size, 4
    n_matmul = L * (d * 3 * d + d * d + 2 * d * 4 * d) + d * V
    n_factors = L * r * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))  # qkv, out, mlp in, mlp out
    assert lora.factor_count(models.build(run.model, jax.random.PRNGKey(0))) == n_factors
    want = 4 * n_matmul + 6 * n_factors + 12 * L * d * T
    assert models.flops_per_token(run.model, T) == want
    assert models.flops_per_token(tiny_run().model, T) == 6 * n_matmul + 12 * L * d * T


def test_lora_group_validation_and_lr_override(tiny_run):
    run = tiny_run(*LORA, "optimizer.groups.lora.lr=5e-3", "optimizer.groups.lora.weight_decay=0.01")
    assert run.optimizer.group_overrides["lora"] == {"lr": 5e-3, "weight_decay": 0.01}
    muon = tiny_run(*LORA, "optimizer=muon", "optimizer.groups.lora.adam_b2=0.99")  # AdamW's knobs under Muon
    assert muon.optimizer.group_overrides["lora"] == {"adam_b2": 0.99}


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override,message", [
    ("model.lora.rank=-1", r"^model\.lora\.rank=-1 must be >= 0"),
    ("model.lora.alpha=0", r"^model\.lora\.alpha=0\.0 must be positive"),
    ("model.lora.dropout=1.0", r"^model\.lora\.dropout=1\.0 must be in \[0, 1\)"),
    ("model.lora.dropout=-0.1", r"^model\.lora\.dropout=-0\.1 must be in \[0, 1\)"),
    ("model.lora.targets=[attn_qkv,q_proj]",
     r"^model\.lora\.targets: 'q_proj' is not a projection of this model; its targets are attn_qkv, attn_out, "
     r"mlp_in, mlp_out$"),
    ("model.lora.targets=[]", r"^model\.lora\.targets=\[\] names no projection"),
    ("+model.lora.ranks=4", r"^unknown knob model\.lora\.ranks"),
])
def test_bad_lora_knobs_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate(compose_config("model.lora.rank=4", override))
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- whole runs

RUN = ("model.vocab_size=null", "train.max_steps=12", "logging.log_every=1", "train.val_freq=6",
       "train.max_val_steps=2", "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3",
       *LORA, "model.lora.dropout=0.1", "optimizer.groups.lora.lr=1e-2")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def train(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    return train_jax.train(compose_config(*RUN, *overrides), str(run_dir)), run_dir


def records(run_dir: Path, name: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[name] for r in lines if name in r}


@pytest.mark.slow
def test_resume_of_a_lora_run_is_bit_identical(tmp_path):
    """Stopped at 5 and resumed: every step's loss, the final factors, the frozen base and the
    optimizer state equal an unbroken run's exactly (both dropouts draw from the state's key)."""
    from test_checkpoint import assert_same_arrays

    train(tmp_path, "full", "checkpoint.save=true", "checkpoint.save_path=ckpt/full")
    _, first = train(tmp_path, "first", "checkpoint.save=true", "checkpoint.save_path=ckpt/seg",
                     "checkpoint.num_steps=5")
    _, second = train(tmp_path, "second", "checkpoint.save=true", "checkpoint.save_path=ckpt/seg",
                      "checkpoint.resume=auto")
    assert complete_steps("ckpt/seg")[-1] == 12
    assert {**records(first, "train/loss"), **records(second, "train/loss")} == records(tmp_path / "full", "train/loss")
    for item in ("model", "opt_state"):
        assert_same_arrays(tmp_path / "ckpt/full/iter_12", tmp_path / "ckpt/seg/iter_12", item)


@pytest.fixture
def chats(tmp_path) -> str:
    """Conversations whose assistant turn is always one of two fixed replies: learnable in a few steps."""
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    lines = [json.dumps({"messages": [{"role": "user", "content": " ".join(rng.choice(words, 3))},
                                      {"role": "assistant", "content": ["yes", "no"][i % 2]}]}) for i in range(80)]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "chats.jsonl")


@pytest.mark.slow
def test_a_lora_run_on_chat_data_lowers_its_assistant_loss(tmp_path, chats):
    """dataset=chat (assistant-only loss) with a frozen random base: the factors alone bring the
    held-out loss down well below its start."""
    _, run_dir = train(tmp_path, "chat", "dataset=chat", "dataset.path=json", f"dataset.data_files=[{chats}]",
                       "dataset.val_fraction=0.2", "model.context_length=48", "train.max_steps=30",
                       "train.val_freq=30", "optimizer.groups.lora.lr=3e-2", "model.dropout=0.0")
    val = records(run_dir, "val/loss")
    assert val[30] < val[0] - 0.1, val


# ----------------------------------------------------------------------------- export

export_script = load_script("export_model")


@pytest.fixture
def lora_ckpt(tmp_path) -> Path:
    train(tmp_path, "run", "checkpoint.save=true", "checkpoint.save_path=ck", "train.max_steps=4",
          "train.skip_validation=true", "model.dropout=0.0")
    return tmp_path / "ck"


@pytest.mark.slow
def test_merge_lora_export_loads_with_the_checkpoints_logits(lora_ckpt, tmp_path):
    """`--merge-lora` writes a plain model (no factors, rank 0) whose logits equal the LoRA
    checkpoint's (tolerance as in the in-memory merge test); without it the export keeps the factors
    and rebuilds the LoRA model exactly; `--format hf` without --merge-lora is refused in one line."""
    _, _, tuned = inference.restore_for_inference(str(lora_ckpt), "latest")
    assert lora.has_factors(tuned)
    assert export_script.main(["ck", "--merge-lora", "--out", "merged"]) == 0
    assert export_script.main(["ck", "--out", "adapter"]) == 0
    config = json.loads((tmp_path / "merged/config.json").read_text())
    assert config["lora"]["rank"] == 0
    assert not any(is_factor(n) for n in load_file(str(tmp_path / "merged/model.safetensors")))
    tokens = np.random.default_rng(1).integers(0, 257, (2, 16), dtype=np.int32)
    logits = eqx.filter_jit(lambda m, t: m(t))
    want = np.asarray(logits(tuned, tokens))
    merged, adapter = export.load_export("merged"), export.load_export("adapter")
    assert not lora.has_factors(merged) and lora.has_factors(adapter)
    np.testing.assert_allclose(np.asarray(logits(merged, tokens)), want, rtol=0,
                               atol=64 * F32_EPS * np.sqrt(128) * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(logits(adapter, tokens)), want)
    with pytest.raises(CheckpointError, match=r"^--format hf: .*LoRA factors.*--merge-lora"):
        models.for_export(tuned, False, "hf")
    with pytest.raises(CheckpointError, match=r"^--merge-lora: this checkpoint has no LoRA factors"):
        models.for_export(models.for_export(tuned, True, "safetensors"), True, "safetensors")


def test_config_json_of_a_lora_export_round_trips(tiny_run, tmp_path):
    run = tiny_run(*LORA, "model.lora.targets=[mlp_in]")
    model = models.build(run.model, jax.random.PRNGKey(0))
    export.save_export(str(tmp_path / "out"), model, 0, {"name": "byte"}, 16)
    cfg, _ = export.read_export_config(str(tmp_path / "out"))
    assert cfg == run.model and cfg.lora.targets == ("mlp_in",)
    assert dataclasses.asdict(cfg)["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ("mlp_in",)}
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def test_llama_lora_moves_only_its_factors_and_merges(tiny_run):
    """The same on the Llama family (its projections are called through Linear, GQA's k/v narrower):
    fresh factors compute the base, a step moves only the factors, the merge keeps the logits."""
    run = tiny_run("model=llama_tiny", *LORA, "model.lora.targets=[q_proj,v_proj,down_proj]",
                   "optimizer.groups.lora.lr=1e-2", "optimizer/lr_config=constant", "optimizer.lr_config.warmup=0")
    _, _, state, step = assemble(run)
    assert {n.split(".")[1] for n in arrays(state.model) if is_factor(n)} == {"q_proj", "v_proj", "down_proj"}
    base = models.for_export(state.model, True, "safetensors")  # B = 0: W + s·A·0 is W, a rank-0 llama
    assert jax.tree.structure(base) == jax.tree.structure(models.abstract(tiny_run("model=llama_tiny").model))
    np.testing.assert_array_equal(np.asarray(state.model(TOKENS_BxT)), np.asarray(base(TOKENS_BxT)))
    before = arrays(state.model)
    for i in range(2):
        state, _ = step(state, batch(run, i), True)
    for name, x in arrays(state.model).items():
        assert (np.abs(x - before[name]).max() > 0) == is_factor(name), name
    logits = eqx.filter_jit(lambda m, t: m(t))
    want = np.asarray(logits(state.model, TOKENS_BxT))
    got = np.asarray(logits(models.for_export(state.model, True, "safetensors"), TOKENS_BxT))
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * F32_EPS * np.sqrt(128) * np.abs(want).max())


def test_a_lora_projection_is_x_w_plus_alpha_over_rank_x_a_b():
    """rank 4, alpha 12 (scale 3, neither 1 nor rank/alpha nor alpha): a targeted projection of
    block 0 against x·W + b + (alpha/rank)·(x·A)·B in float64 NumPy, with A, B and b drawn so every
    term matters. Tolerance: each output is a float32 sum over I = 32 products (x·W), plus the
    branch's two chained sums (32 then r = 4 terms), the scale's product and the two additions:
    at most I + r + 3 roundings of the magnitudes summed (helpers.sum_atol)."""
    rank, alpha = 4, 12.0
    run = validate(compose_config(f"model.lora.rank={rank}", f"model.lora.alpha={alpha}"))
    model = with_random_b(models.build(run.model, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), std=0.5)
    layer = jax.tree.map(lambda a: a[0], model.blocks.mlp_in)  # block 0's LoraLinear
    assert isinstance(layer, lora.LoraLinear)
    layer = eqx.tree_at(lambda m: m.bias_O, layer, 0.1 * jax.random.normal(jax.random.PRNGKey(2), layer.bias_O.shape))
    x_NxI = np.random.default_rng(3).normal(size=(6, layer.weight_IxO.shape[0])).astype(np.float32)
    got = np.asarray(jax.jit(lambda m, x: m(x))(layer, jnp.asarray(x_NxI)), np.float64)

    W, b, A, B = (np.asarray(a, np.float64) for a in (layer.weight_IxO, layer.bias_O, layer.lora_a_IxR,
                                                       layer.lora_b_RxO))
    x = x_NxI.astype(np.float64)
    base, low_rank = x @ W + b, (alpha / rank) * (x @ A) @ B
    want = base + low_rank
    assert np.abs(low_rank).max() > 0.1 * np.abs(base).max()  # the branch is a large part of the output
    scale = np.abs(x) @ np.abs(W) + np.abs(b) + (alpha / rank) * (np.abs(x) @ np.abs(A)) @ np.abs(B)
    err, bound = np.abs(got - want), sum_atol(W.shape[0] + rank + 3, scale)  # elementwise
    assert np.all(err <= bound), (err / bound).max()
