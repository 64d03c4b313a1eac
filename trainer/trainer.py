"""What a run builds before its first step (train_jax.build_trainer); benchmarks, the LR finder
and tests build the same object, so they measure and check the step a real run takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: utils/ does not import the loaders or the config boundary
    import jax
    import optax

    from loaders.pipeline import Data
    from loaders.tokenizers import Tokenizer
    from trainer.step import TrainState
    from trainer.step_metrics import TrainStep
    from utils.config import RunConfig


@dataclass
class Trainer:
    run: RunConfig  # with model.vocab_size resolved from the tokenizer
    mesh: jax.sharding.Mesh
    tokenizer: Tokenizer
    data: Data
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    state: TrainState
    train_step: TrainStep
    evaluate: Callable  # model -> {val/loss, val/perplexity, val/accuracy}
    # state -> the model to evaluate (optimizer.eval_view, weight_average.eval_view); None: state.model
    eval_view: Callable | None = None
    score_tasks: Callable | None = None  # model -> eval/<task>/... (trainer/tasks.py); None without eval.tasks
