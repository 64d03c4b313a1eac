"""train.compute_dtype=float16 with dynamic loss scaling (trainer/loss_scale.py): GradScaler's
rule for the scale, an overflow skipped without touching weights or optimizer state, the unscaled
gradient against float32's, the scale growing while the tiny model learns, the refused knobs, and
float32/bfloat16 runs left as they were. The exact resume of a float16 run (the scale and its count
in the checkpoint) is a case of test_checkpoint.py's test_resume_is_bit_identical."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, restore_item

import train_jax as T
from optimizer.nonfinite import advance_schedules
from trainer import step_metrics
from trainer.loss_scale import LossScale
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

U16 = 2.0**-11  # float16's unit roundoff (10 stored mantissa bits)
F16 = ("train.compute_dtype=float16",)


def assemble(run, metrics=None):
    """(state, step, mesh) on one device, as train_jax builds them."""
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh, metrics=metrics)
    return state, step, mesh


def fixed_batch(mesh, seed: int = 0):
    batch_1xBxT1 = np.random.default_rng(seed).integers(0, 64, (1, 8, 17), dtype=np.int32)
    return meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))


def host(tree):
    """A host copy: the step donates the state's buffers."""
    return jax.tree.map(np.array, tree)


def leaves_equal(a, b) -> None:
    xs, ys = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(xs) == len(ys) and xs
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- the rule


def grad_scaler(flags, init: float, interval: int, growth: float, backoff: float) -> list[tuple[float, int]]:
    """PyTorch's GradScaler.update (torch._amp_update_scale_), in plain Python: (scale, growth
    tracker) after each step whose gradient was finite or not."""
    scale, tracker, out = init, 0, []
    for finite in flags:
        if not finite:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
        out.append((scale, tracker))
    return out


def test_the_scale_follows_grad_scalers_rule():
    """Grows after `interval` finite steps in a row, backs off (and restarts the count) on each
    non-finite one, an overflow in the middle of a count included."""
    flags = [True, True, False, True, True, True, True, True, False, False, True, True, True, True]
    scaler = LossScale(jnp.zeros(()), jnp.zeros((), jnp.int32), 1024.0, 3, 4.0, 0.25).fresh()
    adjust = jax.jit(lambda s, f: s.adjust(f))
    got = []
    for finite in flags:
        scaler = adjust(scaler, jnp.asarray(finite))
        got.append((float(scaler.scale), int(scaler.good_steps)))
    assert got == grad_scaler(flags, 1024.0, 3, 4.0, 0.25)  # powers of two: exact
    assert scaler.scale.dtype == jnp.float32 and scaler.good_steps.dtype == jnp.int32


def test_the_scale_never_grows_to_inf():
    scaler = LossScale(jnp.zeros(()), jnp.zeros((), jnp.int32), 2.0**127, 1, 2.0, 0.5).fresh()
    assert float(scaler.adjust(jnp.asarray(True)).scale) == 2.0**127


# ----------------------------------------------------------------------------- in the train step


def test_an_overflow_halves_the_scale_and_skips_the_step_bit_for_bit(tiny_run):
    """Two finite steps (Adam's moments and counts moving), then the scale forced to 2^60: the
    loss's cotangent, ~2^60/128 tokens, is finite in float32 but inf once the head's backward
    matmul casts it to float16. That step is skipped: weights and every optimizer moment and count
    bit for bit as they were, only the lr schedule's counter advanced (optimizer/nonfinite.py); the
    scale halves and its count of finite steps restarts. The next step overflows again and halves
    it again (no floor: GradScaler has none)."""
    run = tiny_run(*F16, "optimizer=adamw")
    assert run.train.skip_nonfinite  # float16 always skips: an overflow is not a divergence
    state, step, mesh = assemble(run)
    batch = fixed_batch(mesh)
    for _ in range(2):
        state, metrics = step(state, batch)
    assert int(metrics["train/skipped_steps"]) == 0 and int(state.loss_scale.good_steps) == 2
    forced = jax.device_put(jnp.asarray(2.0**60, jnp.float32), state.loss_scale.scale.sharding)
    state = eqx.tree_at(lambda s: s.loss_scale.scale, state, forced)
    model_before, opt_before = host(eqx.filter(state.model, eqx.is_array)), host(state.opt_state)

    state, metrics = step(state, batch)
    assert float(metrics["train/loss_scale"]) == 2.0**60 and not np.isfinite(float(metrics["train/grad_norm"]))
    assert int(metrics["train/skipped_steps"]) == 1 and float(metrics["train/update_norm"]) == 0.0
    assert float(state.loss_scale.scale) == 2.0**59 and int(state.loss_scale.good_steps) == 0
    leaves_equal(eqx.filter(state.model, eqx.is_array), model_before)
    leaves_equal(state.opt_state.inner_state, advance_schedules(opt_before.inner_state, jnp.asarray(True)))
    assert int(state.opt_state.notfinite_count) == 1

    state, metrics = step(state, batch)
    assert int(metrics["train/skipped_steps"]) == 2 and float(state.loss_scale.scale) == 2.0**58
    assert step.compiled() == 1  # the forced scale took the compiled step's own path


def test_the_unscaled_gradient_is_float32s_to_float16_rounding(tiny_run):
    """The gradient the optimizer gets under float16 (loss scaled by 2^15, gradient divided by it)
    against the same step's in float32, as a global relative L2 error, in units of U16.

    The bound: every float16 value a gradient term is built from passed through roundings of
    relative size <= U16: per block the casts and matmul outputs of Block.__call__ (ln1's cast, qkv,
    the attention probabilities, attention output, ln2's cast, mlp_in, gelu, mlp_out: 8), forward
    and, as cotangents, backward, and as many for the head; to first order they add, <= 8·(L+1)·U16
    relative per product of activation and cotangent, L = 2 blocks. The global norm is carried by
    the weight matrices and embeddings, sums of same-sized terms, so no cancellation amplifies it."""
    grads = step_metrics.FnMetric(lambda state, g, updates, aux: {"grads": g})
    got = {}
    for dtype in ("float32", "float16"):
        state, step, mesh = assemble(tiny_run("optimizer=sgdm", f"train.compute_dtype={dtype}"), metrics=[grads])
        assert (state.loss_scale is None) == (dtype == "float32")
        state, metrics = step(state, fixed_batch(mesh))
        got[dtype] = [np.asarray(g, np.float64) for g in jax.tree.leaves(metrics)]
    assert int(state.loss_scale.good_steps) == 1  # the float16 step was scaled and finite

    error = (np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got["float16"], got["float32"])))
             / np.sqrt(sum(np.sum(b**2) for b in got["float32"])))
    assert error <= 8 * (2 + 1) * U16, error / U16
    # Not a float32 gradient in disguise: float16 rounding is there (>= a tenth of one rounding).
    # (That the loss really is multiplied by the scale, the overflow test shows.)
    assert error >= 0.1 * U16, error / U16


def test_the_scale_grows_while_a_tiny_float16_run_learns(tiny_run):
    """growth_interval=3: the logged scale (the one each step used) doubles after every 3 finite
    steps, and the loss of a fixed batch falls at every step, as in float32."""
    run = tiny_run(*F16, "train.loss_scale.growth_interval=3", "optimizer/lr_config=constant",
                   "optimizer.lr_config.lr=1e-2", "optimizer.lr_config.warmup=0")
    state, step, mesh = assemble(run)
    batch = fixed_batch(mesh, seed=1)
    scales, losses = [], []
    for _ in range(7):
        state, metrics = step(state, batch)
        scales.append(float(metrics["train/loss_scale"]))
        losses.append(float(metrics["train/loss"]))
        assert int(metrics["train/skipped_steps"]) == 0
    s = 2.0**15
    assert scales == [s, s, s, 2 * s, 2 * s, 2 * s, 4 * s]
    assert int(state.loss_scale.good_steps) == 1 and float(state.loss_scale.scale) == 4 * s
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses  # it learns, not just drifts


@pytest.mark.slow
def test_a_float32_checkpoint_continues_in_float16_from_the_initial_scale(tmp_path, monkeypatch, capsys):
    """A float32 checkpoint loaded by a float16 run (overwrite_config): its optimizer state lacks
    the skip-non-finite wrapper float16 adds; it loads into the wrapper (no overwrite_optimizer:
    Adam's moments and counts continue), the scale starts at its init, said in one line, and the
    new checkpoints hold it."""
    monkeypatch.chdir(tmp_path)

    def train(name: str, *extra: str) -> None:
        (tmp_path / name).mkdir()
        T.train(compose_config("model.vocab_size=null", "train.val_freq=100", "train.max_val_steps=1",
                               "logging.log_every=1", "checkpoint.save=true", *extra), str(tmp_path / name))

    train("f32", "train.max_steps=3", "checkpoint.save_path=ck32")
    capsys.readouterr()
    train("f16", *F16, "train.max_steps=5", "train.loss_scale.init=256", "checkpoint.load=true",
          "checkpoint.load_path=ck32", "checkpoint.overwrite_config=true", "checkpoint.save_path=ck16")
    said = [line for line in capsys.readouterr().out.splitlines() if "loss scale starts fresh" in line]
    assert len(said) == 1 and "ck32" in said[0], said
    assert not (tmp_path / "ck32" / "iter_3" / "loss_scale").exists()
    records = [json.loads(line) for line in (tmp_path / "f16" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["train/loss_scale"] for r in records if "train/loss_scale" in r} == {4: 256.0, 5: 256.0}
    saved = restore_item(tmp_path / "ck16" / "iter_5" / "loss_scale")
    assert float(saved["scale"]) == 256.0 and int(saved["good_steps"]) == 2
    # Every count in the optimizer state continued from the checkpoint's 3 (a fresh state would hold
    # Adam's count at 2 beside the schedule's 5); the wrapper's own counters start at 0.
    opt = restore_item(tmp_path / "ck16" / "iter_5" / "opt_state")
    counts = {int(v) for p, v in jax.tree_util.tree_flatten_with_path(opt)[0] if "count" in jax.tree_util.keystr(p)
              and "notfinite" not in jax.tree_util.keystr(p)}
    assert counts == {5}, counts
    assert int(opt["total_notfinite"]) == 0


# ----------------------------------------------------------------------------- float32 and bfloat16

# adamw's golden run (tests/test_golden.py's set-up) under train.compute_dtype=bfloat16, recorded
# before float16 existed: (loss logged at step 1, 2, 3; loss of the weights after step 3).
BF16_GOLDEN = [4.182406902313232, 4.140075206756592, 4.066760540008545, 3.989089012145996]
# test_golden.py's RTOL, for the same reason: another CPU's kernels reassociate float32 sums
# (<= ~11 EPS32). A bfloat16 rounding then differs only for an element that this moved across a
# rounding boundary, ~11·EPS32/2⁻⁸ ≈ 3e-4 of them, while rounding all of them (bfloat16 against
# float32) moves these losses by <= 3e-5: a few flipped roundings stay far below 2e-5.
BF16_RTOL = 2e-5


def test_bfloat16_and_float32_runs_have_no_loss_scale_and_unchanged_losses(tiny_run):
    """No scale in the state, none logged, and bfloat16's golden losses as they were (float32's
    are tests/test_golden.py's)."""
    for dtype in ("float32", "bfloat16"):
        run = tiny_run("optimizer=adamw", "train.max_steps=30", "optimizer.lr_config.warmup=5",
                       f"train.compute_dtype={dtype}")
        assert not run.train.skip_nonfinite
        state, step, mesh = assemble(run)
        assert state.loss_scale is None
        if dtype == "float32":
            continue
        batch, losses = fixed_batch(mesh), []
        for _ in range(4):
            state, metrics = step(state, batch)
            losses.append(float(metrics["train/loss"]))
            assert "train/loss_scale" not in metrics
        np.testing.assert_array_less(np.abs(np.subtract(losses, BF16_GOLDEN)), BF16_RTOL * np.abs(BF16_GOLDEN))


# ----------------------------------------------------------------------------- refused knobs


@pytest.mark.parametrize("overrides, message", [
    (("train.param_dtype=float16",), r"train.param_dtype='float16' is refused: .* set train.compute_dtype=float16"),
    ((*F16, "train.param_dtype=bfloat16"), r"train.compute_dtype=float16 needs train.param_dtype=float32"),
    (("train.compute_dtype=float64",), r"train.compute_dtype='float64' must be one of float32, bfloat16, float16"),
    (("train.loss_scale.init=0",), r"train.loss_scale.init=0.0 must be a positive float32 number"),
    (("train.loss_scale.init=-1024",), r"train.loss_scale.init=-1024.0 must be a positive"),
    (("train.loss_scale.init=1e39",), r"train.loss_scale.init=1e\+39 must be a positive float32 number"),
    (("train.loss_scale.growth_interval=0",), r"train.loss_scale.growth_interval=0 must be a positive integer"),
    (("train.loss_scale.growth_factor=1.0",), r"train.loss_scale.growth_factor=1.0 must be > 1"),
    (("train.loss_scale.backoff_factor=0",), r"train.loss_scale.backoff_factor=0.0 must be positive and < 1"),
    (("train.loss_scale.backoff_factor=1.0",), r"train.loss_scale.backoff_factor=1.0 must be positive and < 1"),
    (("+train.loss_scale.min_scale=1",), r"unknown knob train.loss_scale.min_scale"),
])
def test_bad_precision_knobs_are_one_line_config_errors(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_run(*overrides)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- a scale that has moved


def test_unscale_divides_by_the_current_scale_not_the_initial_one():
    """After backoffs and growth the scale is no longer `init`: the gradient is divided by the
    scale the loss was multiplied by. Powers of two: exact."""
    scaler = LossScale(jnp.asarray(2.0**9, jnp.float32), jnp.zeros((), jnp.int32), 2.0**15, 3, 2.0, 0.5)
    g = {"w": jnp.asarray([3.0 * 2.0**9, -2.0**9], jnp.float32), "b": jnp.asarray(2.0**10, jnp.float16)}
    out = jax.jit(lambda s, g: s.unscale(g))(scaler, g)
    np.testing.assert_array_equal(np.asarray(out["w"]), [3.0, -1.0])
    assert out["b"].dtype == jnp.float16 and float(out["b"]) == 2.0


def test_a_moved_scale_still_gives_float32s_gradient(tiny_run):
    """The train step with the scale forced from its init 2^15 down to 2^9 (where backoffs take
    it): the unscaled gradient is float32's within test_the_unscaled_gradient_is_float32s_to_float16_
    rounding's bound, 8·(L+1)·U16 relative. Divided by the initial scale instead it would be 2^-6 of
    it, a relative error of ~1."""
    grads = step_metrics.FnMetric(lambda state, g, updates, aux: {"grads": g})
    got = {}
    for dtype in ("float32", "float16"):
        state, step, mesh = assemble(tiny_run("optimizer=sgdm", f"train.compute_dtype={dtype}"), metrics=[grads])
        if dtype == "float16":
            assert float(state.loss_scale.scale) == 2.0**15
            moved = jax.device_put(jnp.asarray(2.0**9, jnp.float32), state.loss_scale.scale.sharding)
            state = eqx.tree_at(lambda s: s.loss_scale.scale, state, moved)
        state, metrics = step(state, fixed_batch(mesh))
        got[dtype] = [np.asarray(g, np.float64) for g in jax.tree.leaves(metrics)]
    assert int(state.loss_scale.good_steps) == 1  # the float16 step was finite at 2^9

    error = (np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got["float16"], got["float32"])))
             / np.sqrt(sum(np.sum(b**2) for b in got["float32"])))
    assert error <= 8 * (2 + 1) * U16, error / U16
