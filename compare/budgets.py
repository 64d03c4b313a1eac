"""A comparison's budgets in tokens or Chinchilla multiples (`budget_unit=tokens|chinchilla`), turned
into each workload's optimizer steps, so a model-size ladder can hold "1x, 2x, 4x Chinchilla" per size.

A step trains (dataset.total_batch_size or dataset.batch_size) x context_length tokens, as
`data/tokens` counts them. Chinchilla (Hoffmann et al. 2022): 20 training tokens per parameter, the
parameters counted as every run's header and `model/params` count them (embeddings included), from
the model's shapes alone (nothing allocated). A budget is rounded to the nearest step.
"""

from __future__ import annotations

import math

UNITS = ("steps", "tokens", "chinchilla")
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio


def workload_scale(overrides: tuple[str, ...], need_params: bool) -> tuple[int, int | None]:
    """(tokens per optimizer step, parameter count or None) of a run with these overrides. The
    parameter count needs the vocabulary: the run's tokenizer is built (from its cache, as the run's)."""
    import jax
    import numpy as np

    import models
    from loaders.pipeline import source_documents
    from utils.config import compose_overrides, resolve_vocab, validate

    run = validate(compose_overrides(list(overrides), job_name="compare"))
    d = run.dataset
    tokens = (d.total_batch_size or d.batch_size) * run.context_length
    if not need_params:
        return tokens, None
    if run.model.vocab_size is None:
        docs = source_documents(d.source, run.tokenizer.needs_documents, run.config_dict["tokenizer"]["name"])
        run = resolve_vocab(run, run.tokenizer.build(docs[0] if docs else None, run.cache_dir).vocab_size)
    shapes = jax.tree.leaves(models.abstract(run.model, run.train.param_dtype),
                             is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return tokens, int(sum(np.prod(x.shape) for x in shapes if isinstance(x, jax.ShapeDtypeStruct)))


def to_steps(values: tuple[float, ...], unit: str, tokens_per_step: int, params: int | None) -> tuple[int, ...]:
    """The budgets in optimizer steps: `values` are steps, tokens, or multiples of Chinchilla's
    20 tokens per parameter; each rounded to the nearest step (at least 1)."""
    if unit == "steps":
        return tuple(int(v) for v in values)
    tokens = [v * TOKENS_PER_PARAM * params if unit == "chinchilla" else v for v in values]
    return tuple(max(1, int(math.floor(t / tokens_per_step + 0.5))) for t in tokens)
