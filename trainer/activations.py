"""logging.activation_norms: per block, the RMS of the attention output, the MLP output and the
residual stream after the block (`act/<i>/{attn,mlp,resid}_rms`): a growing residual stream or an
exploding branch shows there first.

A logging-only step metric: on logging steps the step runs the model once more, forward only, on
its first micro-batch, with the weights the step started from and without dropout (the values
are what that batch's activations were before this update). The model returns the RMS values
itself (`collect=True`), as the per-block stack the scan over blocks produces; other steps
compile without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from models.losses import unpack_batch

KINDS = ("attn", "mlp", "resid")


@dataclass(frozen=True)
class ActivationNorms:
    """The StepMetric (trainer/step_metrics.py) of logging.activation_norms."""

    num_blocks: int
    compute_dtype: Any = jnp.float32
    causal: bool = True  # the objective's attention (models/objectives.py)
    name: str | None = None  # stateless
    logging_only: bool = True

    def init(self, params) -> None:
        return None

    def update(self, state, inputs, logging: bool) -> tuple[None, dict[str, jax.Array]]:
        batch = jax.tree.map(lambda a: a[0], inputs.batch)  # the first micro-batch
        tokens_BxT1, _, segment_ids_BxT, _ = unpack_batch(batch)
        _, stats = inputs.state.model(tokens_BxT1[:, :-1], compute_dtype=self.compute_dtype,
                                      segment_ids_BxT=segment_ids_BxT, causal=self.causal, collect=True)
        return None, {f"act/{i}/{kind}_rms": stats[kind][i] for kind in KINDS for i in range(self.num_blocks)}
