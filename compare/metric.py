"""The metric a comparison ranks by (`metric=`, conf/compare.yaml): val/loss, or a downstream task's
accuracy (`eval/<task>/acc` or `eval/<task>/acc_norm`, logged by `eval.tasks`: trainer/tasks.py).

Every choice and table of the report reads a result as a number to minimise; an accuracy enters as
its error, 1 − acc, so "lower is better" holds everywhere and the ranking is the accuracy's.
Whether a metric is higher-is-better is known from its name: an accuracy is, val/loss is not.
Fits that assume a loss's shape (D_eff's L(D) = E + A·D^−α) do not apply to an error rate: the report
leaves them out and says so (report.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from utils.errors import ConfigError

LOSS = "val/loss"
TASK_ACCURACY = re.compile(r"^eval/(?P<task>[^/\s]+)/(?P<kind>acc|acc_norm)$")


@dataclass(frozen=True)
class Metric:
    name: str  # the key runs log in metrics.jsonl

    @property
    def is_loss(self) -> bool:
        return self.name == LOSS

    @property
    def task(self) -> str | None:
        """The task file's name (eval.tasks' file name without .jsonl) an accuracy needs; None for val/loss."""
        found = TASK_ACCURACY.match(self.name)
        return found["task"] if found else None

    @property
    def label(self) -> str:
        """What the report's numbers are: val/loss, or the error 1 − eval/<task>/acc."""
        return self.name if self.is_loss else f"1 − {self.name}"

    def score(self, logged: float) -> float:
        """The logged value as a number to minimise: the loss itself, or 1 − the accuracy."""
        return logged if self.is_loss else 1.0 - logged


VAL_LOSS = Metric(LOSS)  # the default: a directory without the knob ranks by val/loss


def parse(name) -> Metric:
    """metric=NAME, checked: val/loss, eval/<task>/acc or eval/<task>/acc_norm; one ConfigError line otherwise."""
    if name is None or name == LOSS:
        return VAL_LOSS
    if not isinstance(name, str) or not TASK_ACCURACY.match(name):
        raise ConfigError(f"metric={name!r} must be {LOSS} or a task's accuracy eval/<task>/acc or "
                          "eval/<task>/acc_norm (<task>: an eval.tasks file's name without .jsonl)")
    return Metric(name)


def task_files(overrides) -> list[str]:
    """The eval.tasks files' names (without folder and .jsonl) that run overrides set."""
    names = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "eval.tasks":
            for item in value.strip("[]").split(","):
                item = item.strip().strip("'\"")
                if item:
                    names.append(re.sub(r"\.jsonl$", "", item.replace("\\", "/").rsplit("/", 1)[-1]))
    return names


def check_logged(metric: Metric, workloads, run_overrides) -> None:
    """An accuracy's task is scored in every workload (eval.tasks among its run overrides or the
    comparison's): otherwise no run logs the metric, and the comparison would rank nothing."""
    if metric.is_loss:
        return
    for name, overrides in workloads:
        tasks = task_files((*run_overrides, *overrides))
        if metric.task not in tasks:
            where = f" in workload {name}" if len(workloads) > 1 else ""
            raise ConfigError(f"metric={metric.name} needs the task {metric.task!r} scored{where}: add the run "
                              f"override eval.tasks=[<dir>/{metric.task}.jsonl] (its tasks now: {tasks or 'none'})")
