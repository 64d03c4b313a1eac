"""Text generation from a trained model, for the end-of-run sample and scripts.

Autoregressive (`generate`): one compiled function takes a fixed-size window and a position, so
generating any number of tokens compiles once; the window slides when the text outgrows the context.
Masked diffusion (`unmask`): the prompt and a run of mask ids fill one window, and N steps of the
bidirectional model reveal them, the most confident (or random) first. Each objective
(models/objectives.py) names its own; both have `generate`'s signature.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


@eqx.filter_jit
def _next_token(model, window_1xT: jax.Array, pos: jax.Array, key: jax.Array, temperature: float):
    """(the id drawn at `pos`, the key for the next draw). The key is split in here: split eagerly,
    it compiles two programs of its own (the split, and unpacking its result), ~2 s of a small
    CPU's time at the start of every run, competing with the step's compilation."""
    key, sub = jax.random.split(key)
    logits_V = model(window_1xT)[0, pos - 1]
    token = jnp.argmax(logits_V) if temperature == 0.0 else jax.random.categorical(sub, logits_V / temperature)
    return token, key


def generate(model, prompt_ids: np.ndarray, num_tokens: int, key: jax.Array,
             temperature: float = 0.8, stop_id: int | None = None, context_length: int | None = None) -> np.ndarray:
    """Prompt + up to `num_tokens` sampled ids (stops early at `stop_id`). `context_length` is the
    window the model was trained on (`dataset.context_length`, which may be shorter than the
    model's): positions beyond it have untrained embeddings, so the window slides within it."""
    T = min(context_length or model.cfg.context_length, model.cfg.context_length)
    ids = [int(i) for i in prompt_ids] or [0]
    for _ in range(num_tokens):
        context = ids[-T:]
        window = np.zeros((1, T), np.int32)
        window[0, : len(context)] = context
        # numpy in: jit converts it as it dispatches (jnp.asarray would compile a program per conversion),
        # and every call sees the same argument kinds (a key put on the model's mesh would compile it again)
        token, key = _next_token(model, window, np.int32(len(context)), np.asarray(key), temperature)
        token = int(token)
        if token == stop_id:
            break
        ids.append(token)
    return np.asarray(ids, np.int32)


def reveal_counts(num_masks: int, steps: int) -> list[int]:
    """How many masks each of `steps` unmasking steps reveals: linear in the step (after step i,
    ⌊num_masks·(steps-i-1)/steps⌋ stay masked), so the last step leaves none."""
    left = [num_masks] + [num_masks * (steps - i - 1) // steps for i in range(steps)]
    return [a - b for a, b in zip(left, left[1:])]


@eqx.filter_jit
def _unmask_step(model, canvas_1xT: jax.Array, open_T: jax.Array, count: jax.Array, key: jax.Array,
                 temperature: float, remasking: str, mask: int) -> jax.Array:
    """The canvas with `count` of its open (still masked) positions revealed: a token is drawn at
    every open position, and the `count` with the highest confidence (the drawn token's probability;
    `remasking=random`: a uniform draw) keep theirs, the others stay masked."""
    logits_TxV = model(canvas_1xT, causal=False)[0].at[:, mask].set(-jnp.inf)
    k_draw, k_rank = jax.random.split(key)
    if temperature == 0.0:
        draw_T = jnp.argmax(logits_TxV, axis=-1)
    else:
        draw_T = jax.random.categorical(k_draw, logits_TxV / temperature, axis=-1)
    if remasking == "random":
        confidence_T = jax.random.uniform(k_rank, open_T.shape)
    else:
        probs_TxV = jax.nn.softmax(logits_TxV, axis=-1)
        confidence_T = jnp.take_along_axis(probs_TxV, draw_T[:, None], axis=-1)[:, 0]
    confidence_T = jnp.where(open_T, confidence_T, -jnp.inf)
    rank_T = jnp.argsort(jnp.argsort(-confidence_T))  # 0 = the most confident open position
    reveal_T = open_T & (rank_T < count)
    return jnp.where(reveal_T, draw_T.astype(canvas_1xT.dtype), canvas_1xT[0])[None]


def unmask(model, prompt_ids: np.ndarray, num_tokens: int, key: jax.Array, temperature: float = 0.8,
           stop_id: int | None = None, context_length: int | None = None, steps: int = 64,
           remasking: str = "confidence") -> np.ndarray:
    """Prompt + `num_tokens` ids (at most context_length-1; the prompt keeps its last ids that fit)
    filled in by `steps` unmasking steps of a masked-diffusion model; cut at the first `stop_id`.
    The window past them stays masked, as in training, where the text goes on; the mask id is the
    vocabulary's last (models/mdlm.py)."""
    T = min(context_length or model.cfg.context_length, model.cfg.context_length)
    mask = model.cfg.vocab_size - 1
    num_tokens = min(num_tokens, T - 1)
    prompt = [int(i) for i in prompt_ids][-(T - num_tokens):] or [0]
    canvas = np.full((1, T), mask, np.int32)
    canvas[0, : len(prompt)] = prompt
    open_T = np.zeros(T, bool)
    open_T[len(prompt) : len(prompt) + num_tokens] = True
    canvas_1xT = jnp.asarray(canvas)
    for count in reveal_counts(num_tokens, steps):
        key, sub = jax.random.split(key)
        if count:
            canvas_1xT = _unmask_step(model, canvas_1xT, jnp.asarray(open_T), jnp.int32(count), sub, temperature,
                                      remasking, mask)
            open_T = np.asarray(canvas_1xT[0]) == mask
            open_T[len(prompt) + num_tokens :] = False
    out = np.asarray(canvas_1xT[0, : len(prompt) + num_tokens])
    stops = np.flatnonzero(out[len(prompt) :] == stop_id) if stop_id is not None else []
    return out[: len(prompt) + int(stops[0])] if len(stops) else out


def printable(text: str) -> str:
    """`text` with control characters (other than newline and tab) shown as escapes: an early
    byte-level model samples raw bytes that would otherwise move the cursor or ring the bell."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def sample_text(model, tokenizer, prompt: str, num_tokens: int, key: jax.Array, temperature: float,
                context_length: int | None = None, generate_fn=generate) -> str:
    """Decoded, printable text of `generate_fn` (the objective's: `generate` or `unmask`) from
    `prompt` (text) with `tokenizer` (anything with encode/decode/eot_id). An empty prompt starts
    after an end-of-text, as every document does; a prompt starts as every training document did,
    with the marks the tokenizer puts before a text (`doc_prefix`: a Llama tokenizer's BOS)."""
    prefix = [int(i) for i in getattr(tokenizer, "doc_prefix", ())]
    prompt_ids = [*prefix, *tokenizer.encode(prompt)] if prompt else [tokenizer.eot_id, *prefix]
    ids = generate_fn(model, prompt_ids, num_tokens, key, temperature, stop_id=tokenizer.eot_id,
                      context_length=context_length)
    return printable(tokenizer.decode(ids))


def sampler(tokenizer, key: jax.Array, temperature: float, context_length: int | None = None, generate_fn=generate):
    """(model, prompt, num_tokens) -> text: `sample_text` with the run's tokenizer, key, temperature
    and objective's generation."""
    return lambda model, prompt, num_tokens: sample_text(model, tokenizer, prompt, num_tokens, key, temperature,
                                                         context_length, generate_fn)
