"""objective=mdlm's validation accuracy (models/mdlm.py eval_sums, read by trainer/hooks.evaluate):
Σ masked·w·hit/t over Σ w, recomputed in NumPy from the masks `corrupt` draws and the bidirectional
logits. tests/test_mdlm.py checks the loss; a random-init model hits almost nothing, so an
accuracy test needs hits: the masks depend on the row's key alone, not its tokens, so the masked
tokens of half the rows are set to what the model predicts there (the corrupted input, and so the
prediction, stays the same)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config, sum_atol

import train_jax
from models import mdlm
from models.objectives import MDLM
from trainer import hooks
from utils.config import validate

V = 64  # the tiny run's vocabulary: the mask id is 63
MASK = V - 1
EPS = 1e-3  # objective.eps's default


@pytest.fixture(scope="module")
def model():
    run = validate(compose_config("objective=mdlm"))
    return eqx.filter_jit(lambda key: train_jax.init_model(run, key))(jax.random.PRNGKey(0))


def test_validation_accuracy_weights_each_masked_hit_by_one_over_t(model, monkeypatch):
    B, T = 8, 16
    keys_B = jax.random.split(jax.random.PRNGKey(21), B)
    monkeypatch.setattr(mdlm, "row_keys", lambda x_BxT, seed=mdlm.VAL_SEED: keys_B)  # masks fixed per row
    batch = np.random.default_rng(22).integers(0, MASK, (B, T + 1)).astype(np.int32)
    _, masked, t = (np.asarray(a) for a in mdlm.corrupt(keys_B, jnp.asarray(batch[:, 1:]), jnp.ones((B, T)), EPS,
                                                        MASK))
    z = np.where(masked, MASK, batch[:, 1:])
    logits = np.asarray(model(jnp.asarray(z), causal=False))[..., :MASK]  # the mask id is never predicted
    pred = logits.argmax(-1)
    half = np.arange(B)[:, None] < B // 2
    batch[:, 1:] = np.where(masked & half, pred, batch[:, 1:])  # z unchanged: only masked tokens moved
    x = batch[:, 1:]
    # The jitted evaluation's logits differ from these by float32 rounding: as in test_mdlm's loss
    # test, ≲ sqrt(128)·8 EPS32 of their scale after a 2-block forward; 8x that as room. A masked
    # position's top two logits further apart than that have the same argmax in both.
    top2 = np.sort(logits, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0])[masked].min() > 64 * np.sqrt(128) * EPS32 * np.abs(logits).max()

    hit = masked & (pred == x)
    assert hit[:B // 2].sum() == masked[:B // 2].sum() > 20 and t.max() > 2 * t.min()  # hits, and 1/t varies
    correct = float((hit / t[:, None]).sum())
    assert abs(correct - hit.sum()) > 0.1 * hit.sum()  # unweighted hits would be far off
    step = eqx.filter_jit(MDLM().eval_sums)
    sums = [float(s) for s in step(model, jnp.asarray(batch), jnp.ones(B), jnp.float32)]
    # Σ over B·T float32 terms hit/t (each one rounding of a quotient): sum_atol of their magnitudes
    assert abs(sums[1] - correct) <= sum_atol(B * T + 1, correct)
    assert sums[2] == B * T

    val = hooks.evaluate(step, model, [(jnp.asarray(batch), jnp.ones(B), jnp.float32)])
    # the division by B·T adds one rounding to the sum's bound
    assert abs(val["val/accuracy"] - correct / (B * T)) <= sum_atol(B * T + 2, correct) / (B * T)
