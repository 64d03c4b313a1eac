"""optimizer.qk_clip_tau: QK-clip (Kimi K2's MuonClip, arXiv 2507.20534 §2.1), on top of any optimizer.

After the optimizer's update, every attention head whose largest pre-softmax logit of this step
(S_max = max over the batch, query and visible key positions of q·k·scale, as the forward that
computed the gradient saw it: models/layers.py `causal_attention(max_logits=True)`) exceeded τ
has its query and key projections (weights, and biases where the model has them) multiplied by
sqrt(τ / S_max) each, so its logits, which are bilinear in q and k, are multiplied by τ / S_max.
Heads at or under τ are untouched to the bit (their scale is exactly 1).

Grouped-query attention (llama with num_kv_heads < num_heads): a key head is shared by a group of
query heads, so query head h is scaled by sqrt(τ / max(S_h, τ)) and key head g by
sqrt(τ / max(max_{h in g} S_h, τ)), the group's worst head (K2's per-head rule where each query
head has its own key; a clipped head's logits then shrink by sqrt(γ_h·γ_g) <= γ_h, to τ or below
at these weights). Unclipped query heads keep their W_q; their shared key is scaled only when a
head of their group was clipped. Scaling only W_q per head (by γ_h / sqrt(γ_g)) would hit τ
exactly, but grows the other heads' queries: the weights would move away from the update.

Nothing new is kept between steps (the scales come from this step's logits), so resume is exact
as before. A non-finite S_max (an overflowed forward; the update is skipped or the run stops on it)
clips nothing. The step metrics: `optim/qk_clip/clipped_heads` (query heads clipped this step,
over all blocks) and `optim/qk_clip/max_logit` (the largest S_max, before the clip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import models

PREFIX = "optim/qk_clip"


def scales(max_logit_LxH: jax.Array, tau: float, kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """(query scale (L, H), key scale (L, kv_heads)): sqrt(τ / max(S, τ)), 1 exactly at S <= τ or a
    non-finite S; the key's S is the max over its group of query heads (h reads kv head h // group)."""
    L, H = max_logit_LxH.shape
    per_kv_LxG = max_logit_LxH.reshape(L, kv_heads, H // kv_heads).max(-1)

    def scale(s):
        s = s.astype(jnp.float32)
        return jnp.where(jnp.isfinite(s), jnp.sqrt(tau / jnp.maximum(s, tau)), 1.0)

    return scale(max_logit_LxH), scale(per_kv_LxG)


def clip(model, max_logit_LxH: jax.Array, tau: float):
    """(`model` with its clipped heads' q and k projections rescaled, the step's qk_clip metrics)."""
    kv_heads = getattr(model.cfg, "kv_heads", model.cfg.num_heads)
    q_LxH, k_LxG = scales(max_logit_LxH, tau, kv_heads)
    clipped_LxH = jnp.isfinite(max_logit_LxH) & (max_logit_LxH > tau)
    metrics = {f"{PREFIX}/clipped_heads": clipped_LxH.sum().astype(jnp.int32),
               f"{PREFIX}/max_logit": max_logit_LxH.max().astype(jnp.float32)}
    return models.scale_query_key(model, q_LxH, k_LxG), metrics


def step_max_logits(aux: dict) -> jax.Array:
    """The step's S_max per block and head: the loss aux's `max_logit`, (micro-batches, L, H), maxed
    over the micro-batches (each micro-batch's forward is the same weights on part of the batch)."""
    return aux["max_logit"].max(axis=0)
