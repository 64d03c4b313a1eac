"""Router statistics over the tokens the loss counts (models/moe.py): with a mask, f, P, the
load-balance loss, the z-loss and the dropped fraction equal a NumPy recomputation over the
unmasked tokens only; a masked token's router logits get no gradient from the router losses; the
batch's loss mask reaches the router through the training loss (a causal model's statistics with
the second half of every row masked, and a padding row, equal those of the unmasked part run
alone); and `balance_pooling=global` against a NumPy port of transformers' Mixtral
`load_balancing_loss_func` (and, in the parity tier, that function itself).

Tolerances: float32 rounding (EPS32) at the values' scale. The routing sums are over ≤ 64 tokens
and ≤ 8 experts: ~(√64 + √8)·EPS32 relative per statistic against float64, 4x margin (RTOL). The
model-level comparison runs the same float32 model on the same tokens twice, once with the masked
positions present: the tiny GPT's longest sums are its 128-term MLP dot products, the attention's
softmax over ≤ 16 keys and the means over ≤ 32 tokens: (√128 + √16 + √32)·EPS32, 4x margin (MODEL_RTOL).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32

from models import losses
from models.gpt import GPT, GPTConfig
from models.moe import MoEConfig, balance_loss, routing
from utils.errors import ConfigError

RTOL = 4 * (math.sqrt(64) + math.sqrt(8)) * EPS32  # see the module docstring
MODEL_RTOL = 4 * (math.sqrt(128) + math.sqrt(16) + math.sqrt(32)) * EPS32  # see the module docstring
N, E, K = 64, 8, 2


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def np_lse(z):
    return np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)


def np_top(p, k):
    """Top-k expert indices per row, ties to the lower index (jax.lax.top_k's order)."""
    return np.argsort(-p, axis=-1, kind="stable")[:, :k]


def np_kept(top_NxK, capacity):
    """Capacity routing's drop rule: every token's first choice before any second, then row order."""
    kept, used = np.zeros(top_NxK.shape, bool), np.zeros(E, int)
    for k in range(top_NxK.shape[1]):
        for n in range(top_NxK.shape[0]):
            e = top_NxK[n, k]
            kept[n, k] = used[e] < capacity
            used[e] += 1
    return kept


def logits_and_mask(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, (N, E)).astype(np.float32)
    mask = (rng.uniform(size=N) < 0.6).astype(np.float32)
    # Masked tokens that would dominate every statistic if they were counted: all on expert 0,
    # with logits large enough to swamp the z-loss.
    logits[mask == 0, 0] += 30.0
    return logits, mask


@pytest.mark.parametrize("capacity", [None, 12])
def test_router_stats_with_a_mask_equal_numpy_over_the_unmasked_tokens(capacity):
    logits, mask = logits_and_mask()
    stats = routing(jnp.asarray(logits), K, capacity, True, jnp.asarray(mask)).stats
    z = logits.astype(np.float64)
    p = np_softmax(z)
    top = np_top(p, K)
    on = mask > 0
    n = on.sum()
    f = np.bincount(top[on].reshape(-1), minlength=E) / (n * K)
    P = p[on].mean(0)
    np.testing.assert_allclose(np.asarray(stats["load"]), f, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(stats["prob"]), P, rtol=RTOL)
    np.testing.assert_allclose(float(stats["load_balance"]), E * np.sum(f * P), rtol=RTOL)
    np.testing.assert_allclose(float(stats["z_loss"]), np.mean(np_lse(z)[on] ** 2), rtol=RTOL)
    # Dropping is decided over every token (masked ones take slots too); the fraction is of the counted ones'.
    want_dropped = 0.0 if capacity is None else 1.0 - np_kept(top, capacity)[on].mean()
    np.testing.assert_allclose(float(stats["dropped"]), want_dropped, rtol=RTOL)
    if capacity is not None:
        assert 0 < want_dropped < 1 - np_kept(top, capacity).mean()  # the case tells the two apart
    # Masking is not a no-op here: every statistic over all tokens differs.
    everyone = routing(jnp.asarray(logits), K, capacity, True).stats
    for kind in ("load_balance", "z_loss"):
        assert abs(float(everyone[kind]) - float(stats[kind])) > 0.1 * abs(float(stats[kind])), kind
    # No token counted: the statistics are 0, not NaN.
    none = routing(jnp.asarray(logits), K, capacity, True, jnp.zeros(N)).stats
    assert all(float(jnp.max(jnp.abs(none[kind]))) == 0.0 for kind in ("load_balance", "z_loss", "load", "prob"))


def test_a_masked_tokens_router_logits_get_no_gradient_from_the_router_losses():
    logits, mask = logits_and_mask(1)

    def router_losses(logits_NxE, mask_N):
        stats = routing(logits_NxE, K, None, True, mask_N).stats
        return stats["load_balance"], stats["z_loss"]

    for i, name in enumerate(("load_balance", "z_loss")):
        g = np.asarray(jax.grad(lambda x, i=i: router_losses(x, jnp.asarray(mask))[i])(jnp.asarray(logits)))
        assert np.all(g[mask == 0] == 0.0), name  # exactly: the masked rows never enter the sums
        assert np.all(np.abs(g[mask > 0]).sum(-1) > 0), name  # every counted token does get a gradient
        # Without the mask the same tokens do get one (the test can tell).
        g_all = np.asarray(jax.grad(lambda x, i=i: router_losses(x, None)[i])(jnp.asarray(logits)))
        assert np.all(np.abs(g_all[mask == 0]).sum(-1) > 0), name


def moe_gpt(**moe) -> GPT:
    cfg = GPTConfig(vocab_size=64, context_length=16, dim=32, num_heads=2, num_blocks=4,
                    moe=MoEConfig(num_experts=4, top_k=2, every=2, **moe))
    return GPT(cfg, jax.random.PRNGKey(3))


@pytest.mark.parametrize("pooling", ["layer", "global"])
def test_the_loss_mask_reaches_the_router_through_the_training_loss(pooling):
    """A causal model's first positions do not see the later ones, so masking the second half of
    every row (and a whole padding row) must give the router statistics of the first halves alone."""
    model = moe_gpt(balance_pooling=pooling)
    B, T, half = 3, 16, 8
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, T + 1), 0, 64)
    mask = np.zeros((B, T), np.float32)
    mask[:2, :half] = 1.0  # row 2: padding
    _, aux = losses.loss_fn(model, {"tokens": tokens, "loss_mask": jnp.asarray(mask)}, None, jnp.float32)
    _, alone = losses.loss_fn(model, tokens[:2, :half + 1], None, jnp.float32)
    for kind in ("load_balance_loss", "router_z_loss"):
        np.testing.assert_allclose(float(aux["moe"][kind]), float(alone["moe"][kind]), rtol=MODEL_RTOL, err_msg=kind)
    for layer, load in alone["moe"]["load"].items():
        np.testing.assert_allclose(np.asarray(aux["moe"]["load"][layer]), np.asarray(load), rtol=MODEL_RTOL,
                                   atol=MODEL_RTOL, err_msg=layer)
    _, unmasked = losses.loss_fn(model, tokens, None, jnp.float32)  # every token counted: not the same
    assert abs(float(unmasked["moe"]["router_z_loss"]) - float(alone["moe"]["router_z_loss"])) > 1e3 * MODEL_RTOL


# ----------------------------------------------------------------------------- pooling over layers


def np_hf_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask=None):
    """transformers 5's Mixtral `load_balancing_loss_func` in float64 NumPy: every layer's logits
    pooled, tokens_per_expert = top-k assignments per counted row (summing to top_k over experts),
    router_prob_per_expert = mean probability, times num_experts."""
    counts, probs, rows = np.zeros(num_experts), np.zeros(num_experts), 0.0
    w = None if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(-1)
    for layer in gate_logits:
        p = np_softmax(np.asarray(layer, np.float64))
        top = np_top(p, top_k)
        ww = np.ones(len(p)) if w is None else w
        np.add.at(counts, top.reshape(-1), np.repeat(ww, top_k))
        probs += (p * ww[:, None]).sum(0)
        rows += ww.sum()
    return num_experts * np.sum(counts / rows * probs / rows)


def layer_stats(seed: int, layers: int = 3):
    rng = np.random.default_rng(seed)
    # Layers routed unevenly, each in its own way, so per-layer and pooled balance differ.
    logits = [rng.normal(0, 1.5, (N, E)) + rng.normal(0, 1.5, E) for _ in range(layers)]
    logits = [x.astype(np.float32) for x in logits]
    mask = (rng.uniform(size=N) < 0.7).astype(np.float32)
    stats = [routing(jnp.asarray(x), K, None, True, jnp.asarray(mask)).stats for x in logits]
    router = {kind: jnp.stack([s[kind] for s in stats]) for kind in stats[0]}
    return logits, mask, router


def test_global_pooling_is_transformers_mixtral_loss_over_top_k_and_layer_pooling_differs():
    logits, mask, router = layer_stats(5)
    hf = np_hf_load_balancing_loss(logits, E, K, mask)
    pooled = float(balance_loss(router, MoEConfig(num_experts=E, top_k=K, balance_pooling="global")))
    np.testing.assert_allclose(pooled, hf / K, rtol=RTOL)  # transformers' loss is top_k times ours
    per_layer = float(balance_loss(router, MoEConfig(num_experts=E, top_k=K, balance_pooling="layer")))
    want_layer = np.mean([np_hf_load_balancing_loss([x], E, K, mask) / K for x in logits])
    np.testing.assert_allclose(per_layer, want_layer, rtol=RTOL)
    assert abs(per_layer - pooled) > 1e3 * RTOL * pooled  # the conventions differ on this case


def test_balance_pooling_is_checked_in_one_line():
    with pytest.raises(ConfigError, match="balance_pooling='mean' must be one of layer, global"):
        MoEConfig(num_experts=4, balance_pooling="mean").check("model.moe")


def test_global_pooling_against_transformers_itself():
    torch = pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral",
                                  reason="parity tier: pip install -e '.[dev,parity]'")
    logits, mask, router = layer_stats(6)
    hf = mixtral.load_balancing_loss_func(tuple(torch.from_numpy(x) for x in logits), E, K,
                                          torch.from_numpy(mask).reshape(1, N))
    pooled = float(balance_loss(router, MoEConfig(num_experts=E, top_k=K, balance_pooling="global")))
    # Both float32 over 3 layers x 64 tokens: (√192 + √8)·EPS32 each side, 4x margin.
    np.testing.assert_allclose(pooled, float(hf) / K, rtol=2 * 4 * (math.sqrt(192) + math.sqrt(8)) * EPS32)
