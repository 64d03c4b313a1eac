"""evaluate(): which validation windows it scores, and that each counts exactly once in val/*."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, logits_atol, mean_loss_atol

import train_jax
from loaders.windows import WindowDataset
from models.losses import cross_entropy, eval_sums
from utils.config import validate
from utils.parallel import mesh as meshlib

WINDOW = 17  # the tiny run's context_length 16, plus the next-token target
BATCH_TARGETS = 8 * (WINDOW - 1)  # a batch's targets, the most one float32 sum of the eval's mean holds


@pytest.fixture(scope="module")
def model():
    run = validate(compose_config())
    return eqx.filter_jit(lambda key: train_jax.init_model(run, key))(jax.random.PRNGKey(0))  # not op by op


@pytest.fixture(scope="module")
def eval_step():
    """One compiled step for the module: it depends on the run only through train.compute_dtype."""
    return eqx.filter_jit(functools.partial(eval_sums, compute_dtype=jnp.float32))


def val_set(num_windows: int, seed: int = 0) -> tuple[WindowDataset, dict[tuple, int]]:
    """Random ids < 64 (the tiny vocab): every window differs, so a row tells which window it is."""
    tokens = np.random.default_rng(seed).integers(0, 64, num_windows * WINDOW).astype(np.uint16)
    val = WindowDataset(tokens, WINDOW)
    index = {tuple(row): i for i, row in enumerate(val.get(np.arange(num_windows)).tolist())}
    assert len(index) == num_windows
    return val, index


def run_eval(run, eval_step, model, val, index=None, seen=None) -> dict[str, float]:
    """evaluate() as the train loop calls it; with `seen`, records the window of every row weighted > 0."""
    mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)

    def spy(model, tokens, *rest):  # *rest: the weights (rows without one count fully)
        weights = np.asarray(rest[0]) if rest else np.ones(tokens.shape[0])
        seen.extend(index[tuple(row)] for row, w in zip(np.asarray(tokens).tolist(), weights) if w > 0)
        return eval_step(model, tokens, *rest)

    return train_jax.make_evaluate(run, val, mesh, spy if seen is not None else eval_step)(model)


@eqx.filter_jit
def one_window(model, tokens_1xT1):
    return cross_entropy(model, tokens_1xT1, None, jnp.float32)


def plain_means(model, val, windows) -> tuple[float, float]:
    """Mean over `windows` of each window's own loss and accuracy, one window at a time."""
    losses, accs = [], []
    for i in windows:
        loss, correct = one_window(model, jnp.asarray(val.get(np.array([i]))))
        losses.append(float(loss))
        accs.append(float(correct) / (WINDOW - 1))
    return float(np.mean(losses)), float(np.mean(accs))


def window_logits(model, val, windows) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(val.get(np.asarray(windows))[:, :-1])))


def test_fewer_windows_than_a_batch_count_each_window_once(tiny_run, eval_step, model):
    run = tiny_run()  # batch_size 8
    val, _ = val_set(3)
    metrics = run_eval(run, eval_step, model, val)
    loss, acc = plain_means(model, val, range(3))
    # A batch wrapped around the 3 windows would weigh them 3:3:2.
    logits = window_logits(model, val, range(3))
    tol = mean_loss_atol(model.cfg, logits, loss, BATCH_TARGETS)
    # tol: mean_loss_atol, 2·logits_atol per token + its logsumexp's (V+1)·u rounding + the mean's, 2x margin
    np.testing.assert_allclose(metrics["val/loss"], loss, rtol=0, atol=tol)
    # Accuracy is exact: both sides count the same hits (no top-2 logits closer than the two sides'
    # error, checked here, so no argmax differs), k/48 either way (k/16 per window is exact, their mean
    # one rounding of the same k/48: the correctly rounded quotient).
    top2 = np.sort(logits, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 2 * logits_atol(model.cfg, logits)  # the premise
    assert metrics["val/accuracy"] == acc
    # exp turns an absolute error δ of the loss into a relative one, e^δ − 1 ≈ δ (δ ≲ 1e-4: 2x covers it)
    # rtol: e^(loss+δ)/e^loss − 1 ≈ δ ≤ tol (the loss's float32 bound above); 2x for exp's own rounding and δ²
    np.testing.assert_allclose(metrics["val/perplexity"], np.exp(loss), rtol=2 * tol)


@pytest.mark.parametrize("num_windows, max_val_steps, expected", [(30, 2, 16), (20, 3, 20)])
def test_evaluates_min_of_val_and_max_val_steps_batches(tiny_run, eval_step, model, num_windows, max_val_steps,
                                                        expected):
    run = tiny_run(f"train.max_val_steps={max_val_steps}")
    val, index = val_set(num_windows)
    seen: list[int] = []
    metrics = run_eval(run, eval_step, model, val, index, seen)
    assert len(seen) == expected and len(set(seen)) == expected  # that many, each once
    loss = plain_means(model, val, seen)[0]
    # atol: mean_loss_atol, 2·logits_atol per token + its logsumexp's (V+1)·u rounding + the mean's, 2x margin
    atol = mean_loss_atol(model.cfg, window_logits(model, val, seen), loss, BATCH_TARGETS)
    # the float32 mean loss against the float64 one: within the bound derived just above
    np.testing.assert_allclose(metrics["val/loss"], loss, rtol=0, atol=atol)


def test_evaluated_windows_are_a_fixed_random_selection(tiny_run, eval_step, model):
    val, index = val_set(40)
    first, again, other_seed = [], [], []
    run_eval(tiny_run("train.max_val_steps=2"), eval_step, model, val, index, first)
    run_eval(tiny_run("train.max_val_steps=2"), eval_step, model, val, index, again)
    run_eval(tiny_run("train.max_val_steps=2", "random_seed=7"), eval_step, model, val, index, other_seed)
    assert len(first) == 16
    assert sorted(first) != list(range(16))  # not the first windows, i.e. not the first files
    assert max(first) >= 16
    assert sorted(again) == sorted(first)  # every evaluation (and resume) scores the same windows
    assert sorted(other_seed) == sorted(first)  # independent of random_seed: seed sweeps compare


def test_masked_windows_count_only_their_masked_in_targets(tiny_run, eval_step, model):
    """val/* over loss-masked windows (chat: the assistant's tokens) against NumPy: the mean over
    masked-in targets only. The mask keeps the targets the model finds hardest, so a mean over
    every target would be clearly lower."""
    n = 11  # one full batch of 8 and a padded one
    tokens = np.random.default_rng(3).integers(0, 64, n * WINDOW).astype(np.uint16)
    rows_NxW = tokens.reshape(n, WINDOW).astype(np.int32)
    logits = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, jnp.asarray(rows_NxW[:, :-1])), np.float64)
    targets_NxT = rows_NxW[:, 1:]
    top = logits.max(-1)
    nll_NxT = top + np.log(np.exp(logits - top[..., None]).sum(-1)) - np.take_along_axis(
        logits, targets_NxT[..., None], -1)[..., 0]
    hit_NxT = logits.argmax(-1) == targets_NxT
    keep_NxT = nll_NxT > np.median(nll_NxT)
    mask = np.zeros((n, WINDOW), np.uint8)
    mask[:, 1:] = keep_NxT  # the stream's mask is per token: a row's loss mask is that of its targets
    val = WindowDataset(tokens, WINDOW, loss_mask=mask.reshape(-1))
    np.testing.assert_array_equal(val.get(np.arange(n))["loss_mask"], keep_NxT)

    metrics = run_eval(tiny_run("train.max_val_steps=2"), eval_step, model, val)
    loss, acc = nll_NxT[keep_NxT].mean(), hit_NxT[keep_NxT].mean()
    assert loss - nll_NxT.mean() > 0.01 * loss  # the test can tell a masked mean from an unmasked one
    # float32: logits exact to a few eps of their scale, and sums over at most n·T terms exact to n·T·eps.
    rtol = n * (WINDOW - 1) * np.finfo(np.float32).eps
    np.testing.assert_allclose(metrics["val/loss"], loss, rtol=rtol)
    np.testing.assert_allclose(metrics["val/accuracy"], acc, rtol=rtol, atol=0)
