"""Weight-decay masks from the model's parameter-group labels (see `models.gpt.param_labels`)."""

from __future__ import annotations

import jax


def decay_mask(labels, decay_embeddings: bool):
    """True where decoupled weight decay applies: block matrices and an untied head always,
    the embeddings only when asked; never biases or norm gains."""
    decayed = {"hidden", "head"} | ({"embed"} if decay_embeddings else set())
    return jax.tree.map(lambda label: label in decayed, labels)
