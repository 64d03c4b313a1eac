"""Downstream task accuracy during training (`eval.tasks`): multiple-choice and cloze tasks from
local JSONL files (loaders/tasks.py), scored by log-likelihood as lm-evaluation-harness scores
them, logged as eval/<task>/acc, acc_norm (multiple choice) and loglik (cloze).

One jitted program per padded length (a few buckets) serves every evaluation of the run, and of
every run in the process with the same compute dtype (the cache below): the model's own forward,
its float32 logits turned into each request's summed log-probability of its continuation and
whether every continuation token was the argmax.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loaders import tasks as tasklib
from trainer import hooks as H
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = ()  # JSONL files (paths resolved at the config boundary); () = off
    every: int | None = None  # steps between scorings; None: whenever val/loss is evaluated
    max_examples: int | None = 500  # the first N examples of each file; None = all
    batch_size: int | None = None  # rows per forward; None = dataset.batch_size

    def check(self, prefix: str) -> None:
        for knob in ("every", "max_examples", "batch_size"):
            value = getattr(self, knob)
            if value is not None and value <= 0:
                raise ConfigError(f"{prefix}.{knob}={value} must be a positive integer or null")
        names = [tasklib.task_name(p) for p in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{prefix}.tasks names two files {twice[0]}.jsonl: their metrics would share "
                              f"eval/{twice[0]}/...; rename one")


def request_scores(model, inputs_BxL, targets_BxL, scored_BxL, compute_dtype, replicated: NamedSharding | None):
    """(summed log-probability of each row's scored targets, whether each was the argmax), per row:
    replicated on every device, so each process reads all rows."""
    logits_BxLxV = model(inputs_BxL, key=None, compute_dtype=compute_dtype)  # float32
    logp_BxL = (jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
                - jax.nn.logsumexp(logits_BxLxV, axis=-1))
    loglik_B = jnp.where(scored_BxL, logp_BxL, 0.0).sum(axis=1)
    greedy_B = jnp.where(scored_BxL, jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL, True).all(axis=1)
    if replicated is not None:
        loglik_B, greedy_B = (jax.lax.with_sharding_constraint(x, replicated) for x in (loglik_B, greedy_B))
    return loglik_B, greedy_B


@functools.lru_cache(maxsize=8)
def scoring_step(compute_dtype: str) -> Callable:
    """`request_scores` jitted, one per compute dtype in a process (like hooks.evaluation_step)."""
    return eqx.filter_jit(functools.partial(request_scores, compute_dtype=compute_dtype))


def task_metrics(task: tasklib.Task, loglik: np.ndarray, greedy: np.ndarray) -> dict[str, float]:
    """The task's metrics from its requests' scores (in `tasklib.requests`' order): multiple choice
    acc = argmax of the summed log-probabilities is gold, acc_norm = the same divided by each
    choice's length (`choice_length`); cloze acc = every continuation token greedy, loglik its mean."""
    prefix = f"eval/{task.name}"
    if task.kind == tasklib.CLOZE:
        return {f"{prefix}/acc": float(np.mean(greedy)), f"{prefix}/loglik": float(np.mean(loglik))}
    acc = norm = 0
    start = 0
    for options, gold in zip(task.choices, task.golds):
        ll = np.asarray(loglik[start:start + len(options)], np.float64)
        start += len(options)
        acc += int(np.argmax(ll) == gold)  # ties: the first, as np.argmax in lm-eval
        norm += int(np.argmax(ll / np.array([tasklib.choice_length(o) for o in options], np.float64)) == gold)
    return {f"{prefix}/acc": acc / len(task.golds), f"{prefix}/acc_norm": norm / len(task.golds)}


class TaskScorer:
    """model -> every task's metrics. The files are read, checked and tokenized when it is built
    (before anything compiles: a bad line fails the run at its start)."""

    def __init__(self, paths: Sequence[str], tokenizer, context_length: int, batch_size: int, mesh,
                 compute_dtype: str, max_examples: int | None = None):
        self.tasks = [tasklib.read_task(p, max_examples) for p in paths]
        self.requests = [tasklib.requests(t, tokenizer, context_length) for t in self.tasks]
        self.context_length, self.step = context_length, scoring_step(compute_dtype)
        rows_per_device = math.prod(mesh.shape[a] for a in meshlib.batch_axes(mesh))
        self.batch_size = -(-batch_size // rows_per_device) * rows_per_device  # whole rows on every device
        self.tokens = meshlib.batch_sharding(mesh, 0)
        self.replicated = NamedSharding(mesh, P()) if jax.process_count() > 1 else None

    def _local(self, x_BxL):
        """This process's rows (all of them on one process), placed on the mesh."""
        n, i = jax.process_count(), jax.process_index()
        rows = len(x_BxL) // n
        return meshlib.put_batch(x_BxL[i * rows:(i + 1) * rows], self.tokens)

    def scores(self, model, reqs) -> tuple[np.ndarray, np.ndarray]:
        """(loglik, greedy) per request, in `reqs`' order."""
        out = [(b.rows_B, self.step(model, self._local(b.inputs_BxL), self._local(b.targets_BxL),
                                    self._local(b.scored_BxL), replicated=self.replicated))
               for b in tasklib.batches(reqs, self.batch_size, self.context_length)]  # all dispatched first
        loglik, greedy = np.zeros(len(reqs)), np.zeros(len(reqs), bool)
        for rows_B, (loglik_B, greedy_B) in out:
            real = rows_B >= 0
            loglik[rows_B[real]], greedy[rows_B[real]] = np.asarray(loglik_B)[real], np.asarray(greedy_B)[real]
        return loglik, greedy

    def __call__(self, model) -> dict[str, float]:
        metrics = {}
        for task, reqs in zip(self.tasks, self.requests):
            metrics.update(task_metrics(task, *self.scores(model, reqs)))
        return metrics


def scorer(run, tokenizer, mesh) -> TaskScorer | None:
    """The run's TaskScorer (`run` a utils.config.RunConfig), None without eval.tasks."""
    e = run.eval
    if not e.tasks:
        return None
    return TaskScorer(e.tasks, tokenizer, run.context_length, e.batch_size or run.dataset.batch_size, mesh,
                      run.train.compute_dtype, e.max_examples)


class TaskEvaluation(H.Evaluation):
    """The tasks scored on Evaluation's schedule (eval.every null: train.val_freq and train.val_at;
    else every eval.every steps), at train.max_steps and, with train.val_at_start, at step 0;
    of `ctx.eval_model()` (Schedule-Free's or train.weight_average's average, when the run has one)."""

    produces = ()

    def __init__(self, score: Callable[[Any], dict[str, float]], every: int | None, val_freq: int, max_steps: int,
                 at_start: bool, val_at: Sequence[int] = ()):
        super().__init__(score, every or val_freq, max_steps, at_start, () if every else val_at)

    def __call__(self, ctx: H.LoopContext) -> None:
        began = H.clock()
        ctx.add(self.evaluate(ctx.eval_model()))
        ctx.add({"time/task_eval_sec": H.clock() - began})
