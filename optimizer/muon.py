"""Muon: Newton–Schulz-orthogonalised momentum for the block matrices, AdamW for the rest.

Block weights are stacked (num_blocks, d_in, d_out) for lax.scan; Muon must orthogonalise each
block's d_in×d_out matrix on its own, so the dimension numbers name axis 1 as the reduction
axis and axis 2 as the output axis, leaving axis 0 a batch axis. (optax.contrib.muon's default
would treat every 2-D leaf as a matrix, embeddings included, and send 3-D leaves to AdamW.)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from optimizer.groups import check_non_negative, check_unit_interval
from utils.errors import ConfigError

STACKED_MATRIX = MuonDimensionNumbers(reduction_axis=1, output_axis=2)


def _stacked_dims(updates):
    return jax.tree.map(lambda _: STACKED_MATRIX, updates)


@dataclass(frozen=True)
class Muon:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    weight_decay: float = 0.0
    decay_embeddings: bool = False
    adam_lr: float = 3e-3  # peak lr of the AdamW groups (embed, head, scalar); lr_config.lr is Muon's
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8

    GROUP_KNOBS = ("lr", "weight_decay", "momentum", "adam_b1", "adam_b2", "adam_eps")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum", "adam_b1", "adam_b2")
        check_non_negative(prefix, self, "weight_decay")
        if self.ns_steps <= 0:
            raise ConfigError(f"{prefix}.ns_steps={self.ns_steps} must be a positive integer")
        if self.adam_lr <= 0 or self.adam_eps <= 0:
            raise ConfigError(f"{prefix}.adam_lr and {prefix}.adam_eps must be positive")

    def default_group_lr(self, group: str, base_lr: float) -> float:
        return base_lr if group == "hidden" else self.adam_lr

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if group != "hidden":
            return optax.adamw(schedule, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                               weight_decay=self.weight_decay)
        return optax.chain(
            scale_by_muon(ns_steps=self.ns_steps, beta=self.momentum, nesterov=self.nesterov,
                          weight_dimension_numbers=_stacked_dims),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
