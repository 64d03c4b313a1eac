"""The next-token losses and evaluation sums, for any model of the registry: a model is called as
`model(inputs_BxT, key=, compute_dtype=, segment_ids_BxT=)` and returns float32 logits. The
training loss adds an MoE model's router losses (models/moe.py); evaluation is the LM loss alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import moe


def unpack_batch(batch) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """(tokens_BxT1, loss_mask_BxT or None, segment_ids_BxT or None, loss_norm or None) of a batch:
    a bare token array, or the loaders' dict (`tokens`, optional `loss_mask` and `segment_ids`, and
    `loss_norm`, the train step's denominator for an exact masked mean over micro-batches)."""
    if not isinstance(batch, dict):
        return batch, None, None, None
    return batch["tokens"], batch.get("loss_mask"), batch.get("segment_ids"), batch.get("loss_norm")


def token_losses(model, batch, key: jax.Array | None, compute_dtype: jnp.dtype
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(next-token loss per position, top-1 hit per position, loss mask or None), all BxT."""
    return _token_losses(model, batch, key, compute_dtype)[:3]


def _token_losses(model, batch, key, compute_dtype, router: bool = False, max_logits: bool = False):
    """token_losses and, with `router`, an MoE model's router statistics (None for a dense model); with
    `max_logits` too, moe.forward's dict of them and the per-head max logits (moe.split_stats)."""
    tokens_BxT1, mask_BxT, segment_ids_BxT, _ = unpack_batch(batch)
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    kwargs = {"key": key, "compute_dtype": compute_dtype, "segment_ids_BxT": segment_ids_BxT}
    # The router statistics count the tokens the loss counts (models/moe.py): input t's loss is target t's.
    logits_BxTxV, stats = (moe.forward(model, inputs_BxT, router_mask_BxT=mask_BxT, max_logits=max_logits, **kwargs)
                           if router
                           else (model(inputs_BxT, **kwargs), None))
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return logz_BxT - target_logit_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT, mask_BxT, stats


def cross_entropy(model, batch, key: jax.Array | None, compute_dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Mean next-token loss and the number of correct top-1 predictions over the window; with a
    loss mask, over the masked-in targets only (chat: the assistant's tokens)."""
    return _cross_entropy(model, batch, key, compute_dtype)[:2]


def _cross_entropy(model, batch, key, compute_dtype, router: bool = False, max_logits: bool = False):
    nll_BxT, hit_BxT, mask_BxT, stats = _token_losses(model, batch, key, compute_dtype, router, max_logits)
    if mask_BxT is None:
        return jnp.mean(nll_BxT), jnp.sum(hit_BxT), stats
    norm = unpack_batch(batch)[3]
    norm = jnp.maximum(mask_BxT.sum(), 1.0) if norm is None else norm
    return jnp.sum(nll_BxT * mask_BxT) / norm, jnp.sum(hit_BxT * mask_BxT), stats


def loss_fn(model, batch, key: jax.Array | None, compute_dtype, max_logits: bool = False) -> tuple[jax.Array, dict]:
    """The train step's loss: (mean loss, aux), aux holding what step metrics may read, per micro-batch.
    With MoE the loss differentiated adds the weighted router losses; aux["loss"] (train/loss) stays
    the LM loss, comparable with val/loss, and aux["moe"] holds the router's (models/moe.py).
    `max_logits` (optimizer.qk_clip_tau): aux["max_logit"], each block's per-head largest attention logit."""
    loss, correct, stats = _cross_entropy(model, batch, key, compute_dtype, router=True, max_logits=max_logits)
    router, max_logit = moe.split_stats(stats, max_logits)
    total, moe_aux = moe.add_router_losses(loss, model, router)
    return total, {"loss": loss, "correct": correct, **moe_aux, **({"max_logit": max_logit} if max_logits else {})}


def eval_sums(model, batch, weights_B: jax.Array, compute_dtype: jnp.dtype
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of counted targets' losses, of their correct predictions, count of counted targets).
    Sums, not means: padding rows weigh 0 and batches add up, so an evaluation averages over real
    (and, with a loss mask, masked-in) targets only."""
    nll_BxT, hit_BxT, mask_BxT = token_losses(model, batch, None, compute_dtype)
    weights_BxT = jnp.broadcast_to(weights_B[:, None], nll_BxT.shape)
    if mask_BxT is not None:
        weights_BxT = weights_BxT * mask_BxT
    return (weights_BxT * nll_BxT).sum(), (weights_BxT * hit_BxT).sum(), weights_BxT.sum()
