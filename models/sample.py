"""Text generation from a trained model, for the end-of-run sample and scripts.

One compiled function takes a fixed-size window and a position, so generating any number of
tokens compiles once; the window slides when the text outgrows the context.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from models.gpt import GPT


@eqx.filter_jit
def _next_token(model: GPT, window_1xT: jax.Array, pos: jax.Array, key: jax.Array, temperature: float):
    logits_V = model(window_1xT)[0, pos - 1]
    if temperature == 0.0:
        return jnp.argmax(logits_V)
    return jax.random.categorical(key, logits_V / temperature)


def generate(model: GPT, prompt_ids: np.ndarray, num_tokens: int, key: jax.Array,
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
        key, sub = jax.random.split(key)
        token = int(_next_token(model, jnp.asarray(window), jnp.int32(len(context)), sub, temperature))
        if token == stop_id:
            break
        ids.append(token)
    return np.asarray(ids, np.int32)


def printable(text: str) -> str:
    """`text` with control characters (other than newline and tab) shown as escapes: an early
    byte-level model samples raw bytes that would otherwise move the cursor or ring the bell."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def sample_text(model: GPT, tokenizer, prompt: str, num_tokens: int, key: jax.Array, temperature: float,
                context_length: int | None = None) -> str:
    """Decoded, printable text of `generate` from `prompt` (text) with `tokenizer` (anything with
    encode/decode/eot_id). An empty prompt starts after an end-of-text, as every document does."""
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    ids = generate(model, prompt_ids, num_tokens, key, temperature, stop_id=tokenizer.eot_id,
                   context_length=context_length)
    return printable(tokenizer.decode(ids))


def sampler(tokenizer, key: jax.Array, temperature: float, context_length: int | None = None):
    """(model, prompt, num_tokens) -> text: `sample_text` with the run's tokenizer, key and temperature."""
    return lambda model, prompt, num_tokens: sample_text(model, tokenizer, prompt, num_tokens, key, temperature,
                                                         context_length)
