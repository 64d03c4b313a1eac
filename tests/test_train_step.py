"""train_jax's compiled step on one device: gradient accumulation, learning, buffer donation,
metrics; and (in a subprocess with 8 forced host devices) the sharded step against the 1-device
one. Assembly as in bench/step_speed.py, with synthetic token batches (no corpus needed)."""

import math
import os

import background
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, ShardedCheck

import train_jax as T
from models import losses
from models.losses import cross_entropy
from trainer import step_metrics
from trainer.step import step_keys
from utils.parallel import mesh as meshlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tolerances from float32 rounding (EPS32 = 2⁻²³ ≈ 1.19e-7) at the scale of the values compared. The
# tiny GPT's longest dot product has 128 terms (the MLP's down projection) and a step's batch 8·16 = 128
# tokens: a sum of n terms rounds to ~√n·EPS32 of its terms' scale. A loss (a mean over the tokens of
# ~log V each, of logits from those dot products) and a gradient (summed over the tokens, backward
# through the dot products) are each within ROUNDING of exact, per path.
ROUNDING = (math.sqrt(128) + math.sqrt(128)) * EPS32
# Two paths, each within ROUNDING; 2x margin (≈ 1.1e-5).
RTOL = 4 * ROUNDING


def scale(x) -> float:
    """The largest magnitude in x: the scale a float32 sum's rounding is relative to."""
    return float(np.abs(np.asarray(x)).max())


def assemble(run):
    """(state, step_fn, schedule, mesh) for `run` on one device, the way train_jax.run_training
    builds them."""
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    schedule, _, state, step = T.init_training(run, mesh)
    return state, step, schedule, mesh


def put(batch_AxBxT1: np.ndarray, mesh) -> jax.Array:
    return meshlib.put_batch(batch_AxBxT1, meshlib.batch_sharding(mesh, 1))


def tokens(shape, vocab=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


def host_params(model) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


# SGD (linear in the gradient, lr 1, no clip) makes the parameter comparison a direct comparison of
# the gradients; momentum carries step 1's gradient into step 2.
SGD = ("optimizer=sgdm", "optimizer.momentum=0.5", "optimizer/lr_config=constant", "optimizer.lr_config.lr=1.0",
       "optimizer.lr_config.warmup=0", "train.gradient_clip_val=null")


def test_gradient_accumulation_matches_one_big_batch(tiny_run):
    batches_SxGxT1 = tokens((2, 8, 17))  # two steps of a global batch of 8 sequences
    results = {}
    for micro in (8, 2):
        run = tiny_run(*SGD, f"dataset.batch_size={micro}", "dataset.total_batch_size=8")
        assert run.dataset.accum_steps == 8 // micro
        state, step, _, mesh = assemble(run)
        init = host_params(state.model)  # the same init for both (same seed)
        losses, norms = [], []
        for batch_GxT1 in batches_SxGxT1:
            state, metrics = step(state, put(batch_GxT1.reshape(8 // micro, micro, 17), mesh))
            losses.append(float(metrics["train/loss"]))
            norms.append(float(metrics["train/grad_norm"]))
        results[micro] = losses, norms, host_params(state.model)

    (loss_1, norm_1, params_1), (loss_4, norm_4, params_4) = results[8], results[2]
    # Accumulating only regroups the sums over the batch's tokens: the losses, and the gradients whose
    # norms these are (the norm's own reduction is the same code on both), differ by RTOL at most.
    np.testing.assert_allclose(loss_4, loss_1, rtol=RTOL)
    np.testing.assert_allclose(norm_4, norm_1, rtol=RTOL)
    assert loss_1[1] != loss_1[0]  # the second step saw updated weights
    for a, b, p0 in zip(params_4, params_1, init, strict=True):
        # SGD, lr 1: the parameters moved by the summed gradients (step 1's counted 1.5 times with
        # momentum 0.5), whose difference is RTOL of the movement's scale; and each of the two steps
        # rounds p + Δp to EPS32/2 of p on each side: 2·EPS32, 2x margin.
        np.testing.assert_allclose(a, b, rtol=4 * EPS32, atol=RTOL * scale(b - p0))


def test_loss_falls_on_a_fixed_batch_with_fresh_dropout_keys(tiny_run):
    run = tiny_run("model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=1e-2",
                   "optimizer.lr_config.warmup=0")
    state, step, _, mesh = assemble(run)
    batch = put(tokens((1, 8, 17), seed=1), mesh)
    losses, keys = [], []
    for _ in range(8):
        keys.append(np.array(state.key))
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    assert abs(losses[0] - np.log(64)) < 0.1  # fresh model: chance level
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(np.isfinite(losses))
    assert len({k.tobytes() for k in keys}) == len(keys)  # a new dropout key every step


def test_dropout_is_applied_with_its_own_key_per_micro_batch(tiny_run):
    """Dropout on, two micro-batches holding the same sequences, plain SGD (lr 1): each micro-batch
    is the loss at its own key of `step_keys` (so the two differ: one key shared by every
    micro-batch, or no dropout at all, would make them equal), and the update is minus the mean of
    the two single-micro-batch gradients at those keys."""
    run = tiny_run("model.dropout=0.5", "optimizer=sgdm", "optimizer.momentum=0.0", "optimizer/lr_config=constant",
                   "optimizer.lr_config.lr=1.0", "optimizer.lr_config.warmup=0", "train.gradient_clip_val=null",
                   "dataset.batch_size=4", "dataset.total_batch_size=8")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    per_micro_batch = step_metrics.FnMetric(lambda s, g, u, aux: {"loss_A": aux["loss"]})
    wanted = [step_metrics.FnMetric(step_metrics.loss), per_micro_batch]
    _, _, state, step = T.init_training(run, mesh, metrics=wanted)
    micro_BxT1 = tokens((4, 17), seed=3)
    _, keys_A = step_keys(state.key, 2)
    assert not np.array_equal(keys_A[0], keys_A[1])
    model = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, state.model)  # the step donates
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t, k: losses.loss_fn(m, t, k, "float32")[0]))
    singles = [value_and_grad(model, jnp.asarray(micro_BxT1), k) for k in keys_A]
    no_dropout = float(value_and_grad(model, jnp.asarray(micro_BxT1), None)[0])

    state, metrics = step(state, put(np.stack([micro_BxT1, micro_BxT1]), mesh))
    loss_A = np.asarray(metrics["loss_A"])
    np.testing.assert_allclose(loss_A, [float(loss) for loss, _ in singles], rtol=RTOL)  # same loss, 2 compilations
    # dropout moves the loss (~4, float32 error ~1e-6) by far more, and differently per key
    assert abs(loss_A[0] - loss_A[1]) > 1e-4 and abs(loss_A.mean() - no_dropout) > 1e-4, (loss_A, no_dropout)
    grads = [[np.asarray(g) for g in jax.tree.leaves(grads)] for _, grads in singles]
    for p_new, p, g0, g1 in zip(host_params(state.model), host_params(model), *grads, strict=True):
        # The update, within RTOL of its scale (two compilations of the gradients); p + Δp rounded to
        # EPS32/2 of p by the step and by NumPy: EPS32, 2x margin.
        update = (g0 + g1) / 2
        np.testing.assert_allclose(p_new, p - update, rtol=2 * EPS32, atol=RTOL * scale(update))


def test_step_donates_state_and_reports_metrics(tiny_run):
    # Plain SGD (no momentum, no clip) with warmup: the update is exactly -lr(step) * grad, and the
    # grad comes from cross_entropy on the pre-step weights, so every metric can be checked.
    run = tiny_run("optimizer=sgdm", "optimizer.momentum=0.0", "optimizer/lr_config=constant",
                   "optimizer.lr_config.lr=0.1", "optimizer.lr_config.warmup=4", "train.gradient_clip_val=null")
    state, step, schedule, mesh = assemble(run)
    batch_1xBxT1 = tokens((1, 8, 17), seed=2)
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(cross_entropy, has_aux=True))
    for i, expected_lr in enumerate([0.025, 0.05, 0.075]):  # warmup: 0.1 * (step + 1) / 4
        (loss, _), grads = grad_fn(state.model, jnp.asarray(batch_1xBxT1[0]), None, jnp.float32)
        grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
        before = host_params(state.model)
        old = state
        state, metrics = step(state, put(batch_1xBxT1, mesh))

        assert {"train/loss", "train/grad_norm", "train/lr"} <= set(metrics)
        assert all(a.is_deleted() for a in jax.tree.leaves(old)), "the step must donate its input state"
        assert int(state.step) == i + 1
        # The schedule is a few float32 operations, each rounding by EPS32/2: 4 of them, 4x margin.
        np.testing.assert_allclose(float(metrics["train/lr"]), expected_lr, rtol=8 * EPS32)
        np.testing.assert_allclose(float(metrics["train/lr"]), float(schedule(i)), rtol=8 * EPS32)
        np.testing.assert_allclose(float(metrics["train/loss"]), float(loss), rtol=RTOL)  # two compilations
        # The step's float32 norm against float64 over the same gradients (RTOL apart): plus its sum of
        # the largest leaf's ≤ 8192 squares (positive terms: ~√8192·EPS32/2 of the sum, halved by the
        # square root), 2x margin.
        norm_rtol = RTOL + 2 * math.sqrt(8192) * EPS32 / 4
        np.testing.assert_allclose(float(metrics["train/grad_norm"]),
                                   np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)), rtol=norm_rtol)
        for p_new, p, g in zip(host_params(state.model), before, grads, strict=True):
            # The update lr·g within RTOL of its scale; p + Δp rounded on each side: EPS32, 2x margin.
            np.testing.assert_allclose(p_new, p - expected_lr * g, rtol=2 * EPS32, atol=RTOL * scale(expected_lr * g))


# --- 8 forced host devices (subprocess: XLA_FLAGS must be set before jax is imported) ------------


@background.setup
def sharded_check(ctx) -> ShardedCheck:
    return ShardedCheck(ctx.tmp_path_factory.mktemp("sharded"), ctx.tmp_path_factory.mktemp("sharded_cache"))


# The meshes only reorder float32 sums. A loss is a mean over the step's 2·8·16 = 256 tokens: ~√256·EPS32
# of its scale (~log V) per mesh, and the parameters it is evaluated at differ by far less (see
# sharded_step_check.PARAM_ATOL, ~1e-6 of ~30k weights moved by lr 1e-2); two meshes, 2x margin (≈ 7.6e-6).
SHARDED_RTOL = 4 * math.sqrt(256) * EPS32


@pytest.fixture(scope="module")
def sharded_result(sharded_check) -> dict:
    return sharded_check.result()


@pytest.mark.slow
def test_sharded_step_matches_single_device(sharded_result):
    r = sharded_result
    assert r["devices"] == 8 and r["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    # Parameters and optimizer state really are split over fsdp, and the batch over all 8 devices.
    assert r["wte_devices"] == 8 and r["wte_shard_shape"] == [32, 32] and r["wte_shape"] == [64, 32]
    assert r["sharded_param_leaves"] >= 8 and r["sharded_opt_leaves"] >= 8
    assert r["batch_shard_rows"] == 1
    assert r["state_shardings_kept"]
    np.testing.assert_allclose(r["losses_8"], r["losses_1"], rtol=SHARDED_RTOL)
    assert r["losses_1"][-1] < r["losses_1"][0]
    assert r["params_allclose"], f"max abs param difference {r['max_param_diff']}"
    assert r["params_moved"] > 1e-3  # the comparison is not between two untouched inits


@pytest.mark.slow
def test_tensor_parallel_and_zero1_match_one_device_with_the_expected_layouts(sharded_result):
    """data 2 x fsdp 2 x tensor 2, and data 8 with the optimizer state split over data (ZeRO-1)."""
    r = sharded_result
    tp, z1 = r["tensor"], r["zero1"]
    np.testing.assert_allclose(tp["losses"], r["losses_1"], rtol=SHARDED_RTOL)
    np.testing.assert_allclose(z1["losses"], r["losses_1"], rtol=SHARDED_RTOL)
    assert tp["params_allclose"] and z1["params_allclose"] and tp["kept"] and z1["kept"]
    # Column-parallel qkv and mlp_in, row-parallel attn_out and mlp_out; Adam's moment like its weight.
    assert tp["specs"]["qkv"] == tp["specs"]["mlp_in"] == tp["specs"]["mu_mlp_in"] == ["None", "fsdp", "tensor"]
    assert tp["specs"]["attn_out"] == tp["specs"]["mlp_out"] == ["None", "tensor", "fsdp"]
    # ZeRO-1: weights replicated, their optimizer state split over data.
    assert z1["sharded_param_leaves"] == 0 and z1["sharded_opt_leaves"] > 8
    assert z1["specs"]["mlp_in"] == ["None", "None", "None"] and "data" in z1["specs"]["mu_mlp_in"]


@pytest.mark.slow
def test_a_checkpoint_saved_under_one_layout_restores_under_another(sharded_result):
    """Saved by data 8 with ZeRO-1, restored by data 4 x fsdp 2: the same arrays, now split over
    fsdp, and the next step's loss is the saving layout's."""
    r = sharded_result["cross_topology"]
    assert r["restored_equal"] and r["restored_step"] == 2
    assert r["restored_opt_split_over"] == ["fsdp"]
    np.testing.assert_allclose(r["loss_restoring_mesh"], r["loss_saving_mesh"], rtol=SHARDED_RTOL)


@pytest.mark.slow
def test_batch_not_divisible_by_devices_is_a_config_error(sharded_result):
    assert "dataset.batch_size=12" in sharded_result["bad_batch_error"]
    assert "parallel.data" in sharded_result["bad_mesh_error"]


@pytest.mark.slow
def test_every_optimizer_runs_sharded_and_matches_one_device(sharded_result):
    from optimizer import OPTIMIZERS

    assert set(sharded_result["optimizers"]) == set(OPTIMIZERS)
    for name, r in sharded_result["optimizers"].items():
        assert r["sharded_opt_leaves"] > 0, name  # optimizer state is split (data 2 x fsdp 2 x tensor 2) too
        # Shampoo's statistics and roots (SOAP's statistics) follow their parameters over the tensor axis as well.
        assert (r["tensor_split_stats"] > 0) == (name in ("shampoo", "soap")), (name, r["tensor_split_stats"])
        # Loose: sign-based (Lion) and normalising (Muon, Adam-eps 1e-8) updates amplify float
        # summation-order differences a little; a wrong sharding gives O(1) differences.
        np.testing.assert_allclose(r["losses_8"], r["losses_1"], rtol=2e-4, err_msg=name)
