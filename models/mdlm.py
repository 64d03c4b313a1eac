"""Masked diffusion (MDLM, Sahoo et al. 2024; LLaDA, Nie et al. 2025): the corruption, the loss and
the validation sums.

Per sequence a masking rate t ~ U(eps, 1); each token becomes the mask id with probability t; the
model sees the corrupted sequence with bidirectional attention and predicts the original token at
the masked positions. Weighting each masked position's cross-entropy by 1/t gives the
continuous-time negative ELBO of the linear schedule, an upper bound on the per-token negative
log-likelihood: E[masked/t] = 1 per position, so the weights are unbiased whatever t is drawn.

The mask id is the vocabulary's last id, `model.vocab_size - 1`: the padding past the tokenizer's
ids leaves it free (utils.config.resolve_vocab makes sure), so the model needs no new rows and any
checkpoint says its own mask id. The model never predicts it (its logit is dropped: the "zero
masking probabilities" of MDLM's SUBS parameterisation).

Sequence alignment: a window holds context_length+1 tokens; the AR objective's inputs are the
first context_length and its targets the last. Masked diffusion denoises the last context_length
(the targets), so the loader's loss mask (chat: 1 on the assistant's tokens) lines up with them
exactly and only masked-in tokens are ever masked; the segment ids (which belong to the inputs)
move one place left, the last token taking its predecessor's document unless its loss mask is 0
(a document start under dataset.document_mask), when it is put alone in a document of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import moe
from models.losses import unpack_batch

# Rows of the validation windows are masked with keys from this seed and the row's own tokens: the
# same window gets the same t and mask at every evaluation, in any batch, on any number of devices.
VAL_SEED = 20240624


def mask_id(model) -> int:
    return model.cfg.vocab_size - 1


def sequences(batch) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """(tokens x_BxT to denoise, maskable weights w_BxT, their segment ids or None, the step's loss
    norm or None) of a loader batch (see the module docstring for the alignment)."""
    tokens_BxT1, mask_BxT, seg_in_BxT, norm = unpack_batch(batch)
    x_BxT = tokens_BxT1[:, 1:]
    w_BxT = jnp.ones(x_BxT.shape, jnp.float32) if mask_BxT is None else mask_BxT.astype(jnp.float32)
    seg_BxT = None
    if seg_in_BxT is not None:
        last_Bx1 = seg_in_BxT[:, -1:] + (w_BxT[:, -1:] == 0).astype(seg_in_BxT.dtype)
        seg_BxT = jnp.concatenate([seg_in_BxT[:, 1:], last_Bx1], axis=1)
    return x_BxT, w_BxT, seg_BxT, norm


def corrupt(keys_B: jax.Array, x_BxT: jax.Array, w_BxT: jax.Array, eps: float, mask: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(corrupted z_BxT, masked_BxT bool, t_B), row b drawn from its own key: t_b ~ U(eps, 1), then
    each token with weight > 0 replaced by `mask` with probability t_b (a token weighing 0 never is)."""
    T = x_BxT.shape[1]

    def draw(key):
        k_t, k_mask = jax.random.split(key)
        t = eps + (1.0 - eps) * jax.random.uniform(k_t, (), jnp.float32)
        return t, jax.random.uniform(k_mask, (T,), jnp.float32)

    t_B, u_BxT = jax.vmap(draw)(keys_B)
    masked_BxT = (u_BxT < t_B[:, None]) & (w_BxT > 0)
    return jnp.where(masked_BxT, mask, x_BxT), masked_BxT, t_B


def denoise_losses(model, z_BxT: jax.Array, x_BxT: jax.Array, seg_BxT: jax.Array | None, key: jax.Array | None,
                   compute_dtype, w_BxT: jax.Array | None = None, max_logits: bool = False
                   ) -> tuple[jax.Array, jax.Array, dict | None]:
    """(cross-entropy of the original token at every position, top-1 hit), both BxT, from the
    bidirectional model's logits over every id but the mask id; and an MoE model's router statistics,
    over the maskable tokens (`w_BxT` > 0; all when None) (with `max_logits`: moe.forward's dict of
    them and the per-head max logits)."""
    logits_BxTxV, router = moe.forward(model, z_BxT, router_mask_BxT=w_BxT, key=key, compute_dtype=compute_dtype,
                                       segment_ids_BxT=seg_BxT, causal=False, max_logits=max_logits)
    logits_BxTxV = logits_BxTxV.at[..., mask_id(model)].set(-jnp.inf)
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, x_BxT[..., None], axis=-1)[..., 0]
    return logz_BxT - target_BxT, jnp.argmax(logits_BxTxV, axis=-1) == x_BxT, router


def weighted_sums(model, batch, keys_B: jax.Array, dropout_key: jax.Array | None, eps: float, compute_dtype,
                  max_logits: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, dict | None]:
    """Per row: Σ masked·w·nll/t (the negative ELBO's sum), Σ masked·w·hit/t (top-1 accuracy at the
    masked positions, averaged over t the same way), Σ w (the tokens it bounds); the loss norm; an
    MoE model's router statistics (None for a dense one)."""
    x_BxT, w_BxT, seg_BxT, norm = sequences(batch)
    z_BxT, masked_BxT, t_B = corrupt(keys_B, x_BxT, w_BxT, eps, mask_id(model))
    nll_BxT, hit_BxT, router = denoise_losses(model, z_BxT, x_BxT, seg_BxT, dropout_key, compute_dtype, w_BxT,
                                              max_logits)
    weight_BxT = jnp.where(masked_BxT, w_BxT / t_B[:, None], 0.0)
    nelbo_BxT = jnp.where(masked_BxT, weight_BxT * nll_BxT, 0.0)  # an unmasked nll never enters, not even as 0·inf
    return nelbo_BxT.sum(-1), (weight_BxT * hit_BxT).sum(-1), w_BxT.sum(-1), norm, router


def train_keys(key: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(one masking key per row, the dropout key) from a micro-batch's key."""
    mask_key, dropout_key = jax.random.split(key)
    return jax.random.split(mask_key, rows), dropout_key


def loss_fn(model, batch, key: jax.Array, compute_dtype, eps: float, max_logits: bool = False
            ) -> tuple[jax.Array, dict]:
    """The train step's loss: the negative ELBO per maskable token (train/loss is a bound, like val/loss).
    `key` (from the train state, one per micro-batch) draws every row's t and mask, and dropout's keys.
    `max_logits` (optimizer.qk_clip_tau): aux["max_logit"], each block's per-head largest attention logit."""
    keys_B, dropout_key = train_keys(key, unpack_batch(batch)[0].shape[0])
    nelbo_B, correct_B, count_B, norm, stats = weighted_sums(
        model, batch, keys_B, dropout_key if model.cfg.dropout > 0 else None, eps, compute_dtype, max_logits)
    router, max_logit = moe.split_stats(stats, max_logits)
    norm = jnp.maximum(count_B.sum(), 1.0) if norm is None else norm
    loss = nelbo_B.sum() / norm
    total, moe_aux = moe.add_router_losses(loss, model, router)  # train/loss stays the bound; aux["moe"]: the router's
    clip_aux = {"max_logit": max_logit} if max_logits else {}  # optimizer.qk_clip_tau's (trainer/qk_clip.py)
    return total, {"loss": loss, "correct": correct_B.sum(), **moe_aux, **clip_aux}


def row_keys(x_BxT: jax.Array, seed: int = VAL_SEED) -> jax.Array:
    """One key per row from the row's tokens (a uint32 hash with fixed random odd multipliers): a
    window's t and mask depend on the window alone, not on its batch or its place in it."""
    mult_T = np.random.default_rng(seed).integers(1, 2**32, x_BxT.shape[1], dtype=np.uint32) | 1
    h_B = (x_BxT.astype(jnp.uint32) * jnp.asarray(mult_T)).sum(-1, dtype=jnp.uint32)
    return jax.vmap(lambda h: jax.random.fold_in(jax.random.PRNGKey(seed), h))(h_B)


def eval_sums(model, batch, weights_B: jax.Array, compute_dtype, eps: float
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Σ negative-ELBO terms, Σ 1/t-weighted hits, Σ counted tokens) over the rows weighted by
    `weights_B` (padding rows weigh 0), each row corrupted with its `row_keys` key: val/loss is the
    bound per token, with the same t and masks at every evaluation, resume and run."""
    keys_B = row_keys(sequences(batch)[0])
    nelbo_B, correct_B, count_B, *_ = weighted_sums(model, batch, keys_B, None, eps, compute_dtype)
    return (weights_B * nelbo_B).sum(), (weights_B * correct_B).sum(), (weights_B * count_B).sum()
