"""MoE router losses (models/moe.py) with more than one MoE layer: the training loss adds each
coefficient times the router loss averaged over the MoE layers (as the module docstring says), and
the load-balance loss alone moves the router's gradient, by its own NumPy derivative. Unmasked
batches throughout (how masked tokens are counted is tests/test_moe.py's)."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import rounding_rtol, sum_atol

from models import losses
from models.gpt import GPT, GPTConfig
from models.moe import MoEConfig, routing

CFG = GPTConfig(vocab_size=64, context_length=16, dim=32, num_heads=2, num_blocks=2)


def sharp_routers(model):
    """The MoE layers' routers scaled up, each by its own factor: at init (std 0.02) both route
    almost uniformly and their losses agree to 1e-5, so a mean could not be told from one layer's."""
    w = model.blocks.moe.router.weight_IxO
    scaled = w * jnp.asarray([30.0, 100.0])[:, None, None]
    return eqx.tree_at(lambda m: m.blocks.moe.router.weight_IxO, model, scaled)


def test_router_losses_are_averaged_over_the_moe_layers():
    """2 blocks, both MoE (every=1). The model's per-layer statistics differ, and
    moe/load_balance_loss, moe/router_z_loss and what the training loss adds to the LM loss
    (aux["loss"]) are their means (not their sum, nor one layer's)."""
    tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 17), 0, 64)
    moe = MoEConfig(num_experts=4, top_k=2, every=1, load_balance_coef=3.0, z_loss_coef=5.0)
    model = sharp_routers(GPT(dataclasses.replace(CFG, moe=moe), jax.random.PRNGKey(0)))
    total, aux = jax.jit(losses.loss_fn, static_argnums=3)(model, tokens, None, jnp.float32)
    _, stats = jax.jit(functools.partial(GPT.__call__, collect=True))(model, tokens[:, :-1])
    per_layer = {k: np.asarray(stats["moe"][k], np.float64) for k in ("load_balance", "z_loss")}
    assert per_layer["load_balance"].shape == (2,) and set(aux["moe"]["load"]) == {"0", "1"}
    balance, z = float(aux["moe"]["load_balance_loss"]), float(aux["moe"]["router_z_loss"])
    for name, got in (("load_balance", balance), ("z_loss", z)):
        v = per_layer[name]
        # a mean of 2 float32 values: one addition and one halving, relative to them
        np.testing.assert_allclose(got, v.mean(), rtol=rounding_rtol(2))
        assert abs(v[0] - v[1]) > 100 * rounding_rtol(2) * v.mean()  # so one layer's value would fail that
    # total = LM loss + 3·balance + 5·z in float32: 2 products and 2 additions, each one rounding of
    # at most the terms' summed magnitude (helpers.sum_atol)
    size = abs(float(aux["loss"])) + 3.0 * balance + 5.0 * z
    assert abs(float(total) - (float(aux["loss"]) + 3.0 * balance + 5.0 * z)) <= sum_atol(4, size)


def test_the_load_balance_loss_alone_reaches_the_router_gradient():
    """z_loss_coef = 0: the router's gradient under load_balance_coef = 2 differs from that under 0
    (the load-balance loss, not the z-loss, reaches it). And one layer's load-balance loss E·Σ f_e·P_e
    differentiated by the router weight against NumPy: f is counted (no gradient), P_e the mean
    softmax, so dL/dW = (E/N)·Σ_n x_n ⊗ p_n⊙(f − p_n·f)."""
    tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 17), 0, 64)
    grads = {}
    for coef in (0.0, 2.0):
        moe = MoEConfig(num_experts=4, top_k=2, every=1, load_balance_coef=coef, z_loss_coef=0.0)
        model = GPT(dataclasses.replace(CFG, moe=moe), jax.random.PRNGKey(0))
        grad = jax.jit(jax.grad(lambda m: losses.loss_fn(m, tokens, None, jnp.float32)[0]))(model)
        grads[coef] = np.asarray(grad.blocks.moe.router.weight_IxO)
    assert grads[0.0].shape[0] == 2  # both MoE layers' routers
    for layer in range(2):
        assert np.abs(grads[2.0][layer] - grads[0.0][layer]).max() > 1e-3 * np.abs(grads[0.0][layer]).max()

    N, D, E, K = 48, 8, 4, 2
    x_NxD = np.random.default_rng(3).normal(size=(N, D)).astype(np.float32)
    w_DxE = np.random.default_rng(4).normal(size=(D, E)).astype(np.float32)

    def balance(w):
        return routing(jnp.asarray(x_NxD) @ w, K, None, True).stats["load_balance"]

    got = np.asarray(jax.jit(jax.grad(balance))(jnp.asarray(w_DxE)), np.float64)
    x, w = x_NxD.astype(np.float64), w_DxE.astype(np.float64)
    logits = x @ w
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    f = np.bincount(top.reshape(-1), minlength=E) / (N * K)
    g_NxE = p * (f - (p * f).sum(-1, keepdims=True))
    want = (E / N) * x.T @ g_NxE
    assert np.abs(want).max() > 0
    # Per entry a sum over N tokens of x·g, g a softmax-Jacobian product (E terms, a few float32
    # roundings each: softmax, the products, the subtraction): the terms' magnitudes summed, N + E
    # roundings plus 8 for the softmax and products (helpers.sum_atol)
    scale = (E / N) * np.abs(x).T @ (p * (f + (p * f).sum(-1, keepdims=True)))
    err, bound = np.abs(got - want), sum_atol(N + E + 8, scale)
    assert np.all(err <= bound), (err / bound).max()
