"""logging.activation_norms (trainer/activations.py): the model's per-block RMS values against
the residual stream computed block by block, and the step metric on logging steps only."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config

import train_jax as T
from models.gpt import GPT, GPTConfig
from utils.config import validate
from utils.parallel import mesh as meshlib

CFG = GPTConfig(vocab_size=64, context_length=16, dim=32, num_heads=2, num_blocks=3)


def stream(model: GPT, tokens_BxT) -> list[np.ndarray]:
    """The residual stream before block 0 and after each block, by calling the blocks one by one."""
    x = (jnp.take(model.wte_VxD, tokens_BxT, axis=0) + model.wpe_TxD[: tokens_BxT.shape[1]]).astype(jnp.float32)
    out = [np.asarray(x, np.float64)]
    for i in range(CFG.num_blocks):
        block = jax.tree.map(lambda a, i=i: a[i], model.blocks)
        x = block(x, None, CFG, jnp.float32)
        out.append(np.asarray(x, np.float64))
    return out


def rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a))))


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("zeroed", ["mlp_out", "attn_out"])
def test_block_rms_values_against_the_stream(scan, zeroed):
    """With one branch's output projection zeroed, a block adds only the other branch, so that
    branch's RMS is the RMS of the stream's change, the zeroed one's is 0, and `resid` is the RMS
    of the stream after the block. Tolerance: float32 sums over B·T·D = 512 terms, a few EPS32 relative."""
    model = GPT(dataclasses.replace(CFG, scan_blocks=scan), jax.random.PRNGKey(0))
    model = eqx.tree_at(lambda m: getattr(m.blocks, zeroed).weight_IxO, model,
                        jnp.zeros_like(getattr(model.blocks, zeroed).weight_IxO))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
    logits, stats = model(tokens, collect=True)
    np.testing.assert_array_equal(logits, model(tokens))  # collecting changes nothing else
    xs = stream(model, tokens)
    live, dead = ("attn", "mlp") if zeroed == "mlp_out" else ("mlp", "attn")
    assert {k: v.shape for k, v in stats.items()} == {"attn": (3,), "mlp": (3,), "resid": (3,)}
    for i in range(CFG.num_blocks):
        change, after = rms(xs[i + 1] - xs[i]), rms(xs[i + 1])
        assert change > 1e-3
        np.testing.assert_allclose(float(stats[live][i]), change, rtol=32 * EPS32 * after / change)
        np.testing.assert_allclose(float(stats["resid"][i]), after, rtol=16 * EPS32)
        assert float(stats[dead][i]) == 0.0


def test_logged_on_logging_steps_only_at_the_starting_weights():
    run = validate(compose_config("logging.activation_norms=true"))
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch_1xBxT1 = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    _, want = state.model(jnp.asarray(batch_1xBxT1[0, :, :-1]), collect=True)
    want = jax.tree.map(np.asarray, want)
    batch = meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))
    state, metrics = step(state, batch, True)
    for i in range(2):
        for kind in ("attn", "mlp", "resid"):
            np.testing.assert_allclose(float(metrics[f"act/{i}/{kind}_rms"]), want[kind][i], rtol=16 * EPS32)
    _, plain = step(state, batch, False)
    assert not [k for k in plain if k.startswith("act/")]
    off = validate(compose_config())
    assert not [m for m in T.default_metrics(off, lambda s: 1e-3, None) if type(m).__name__ == "ActivationNorms"]
