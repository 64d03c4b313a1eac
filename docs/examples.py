"""The extension examples of docs/extending.md, as code that runs: each of its blocks
is copied verbatim from here, and tests/test_docs_examples.py registers and calls every one.

A data source, a logging sink, a periodic job (hook), a step metric and a stateful one. (The optimizer example is
optimizer/lion.py itself.)
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from loaders import corpus
from trainer import hooks as H
from trainer import step_metrics
from utils.errors import ConfigError

# --- a data source: register with SOURCES["lines"] = Lines -------------------------------------

@dataclass(frozen=True)
class Lines:                                   # dataset=lines dataset.path=notes.txt
    name: ClassVar[str] = "lines"
    path: str = ""
    val_fraction: float = 0.05

    def check(self, prefix: str) -> None:
        if not self.path:
            raise ConfigError(f"{prefix}.path is empty: name a text file")

    def documents(self):                       # (train, val), fingerprinted now, read on first use
        def read():
            with open(self.path, encoding="utf-8") as f:
                return [(f"{self.path}:{i}", line) for i, line in enumerate(f) if line.strip()]

        return corpus.lazy_splits([self.path], (self.name, self.val_fraction), read, self.val_fraction, self.path)


# --- a logging sink: register with SINKS["csv"] = Csv --------------------------------------------

@dataclass(frozen=True)
class Csv:                                     # logging.csv_file=metrics.csv (add it to logging.yaml)
    csv_file: str | None = None

    def build(self, run_dir, total_steps, start_step, config, saved=None):
        return CsvSink(os.path.join(run_dir, self.csv_file)) if self.csv_file else None


class CsvSink:
    """One row per logged step: step, name, value (a resumed run appends)."""

    def __init__(self, path: str):
        self._file = open(path, "a", newline="")
        self._rows = csv.writer(self._file)

    def log(self, step: int, metrics: dict) -> None:
        self._rows.writerows([step, name, value] for name, value in metrics.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# --- a periodic job: append to the list in train_jax.make_hooks, before H.Log -----------------

class WeightNorms(H.Hook):
    """Per-block weight norms every 100 steps, logged with the step's other values."""
    every = 100

    def __call__(self, ctx):
        blocks = ctx.state.model.blocks.mlp_in.weight_IxO          # (blocks, D, 4D)
        ctx.add({f"weights/mlp_in/{i}": float(n) for i, n in enumerate(jnp.linalg.norm(blocks, axis=(1, 2)))})


# --- a step metric: add to the metrics train_jax.init_training builds (or pass metrics=...) ---

def max_update(state, grads, updates, aux):
    return {"optim/max_abs_update": jnp.stack([jnp.abs(u).max() for u in jax.tree.leaves(updates)]).max()}


MAX_UPDATE = step_metrics.FnMetric(max_update, logging_only=True)


# --- a stateful step metric: its state lives in TrainState.metric_states["loss_ema"] ----------

@dataclass(frozen=True)
class LossEMA:                                 # an exponential moving average of the train loss
    decay: float = 0.9
    name: ClassVar[str] = "loss_ema"           # the state's key (saved in checkpoints, resumed exactly)
    logging_only: ClassVar[bool] = False       # updated at every step, not only on logging steps

    def init(self, params):
        return {"ema": jnp.zeros((), jnp.float32), "steps": jnp.zeros((), jnp.int32)}

    def update(self, state, inputs, logging):
        steps = state["steps"] + 1
        ema = self.decay * state["ema"] + (1 - self.decay) * inputs.aux["loss"].mean()
        unbiased = ema / (1 - self.decay ** steps)                     # Adam's bias correction
        return {"ema": ema, "steps": steps}, {"train/loss_ema": unbiased}
