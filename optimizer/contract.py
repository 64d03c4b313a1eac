"""The optimizer contract, in one place: what every optimizer of `conf/optimizer/` is and may
declare, with the defaults an optimizer that declares nothing gets.

An optimizer is a frozen dataclass subclassing `Optimizer`: its fields are its knobs
(`optimizer.<knob>`, each in its yaml with a comment), `transform(group, schedule)` returns the
optax update of one parameter group (`hidden`, `embed`, `head`, `scalar`, `lora`) whose last
stage applies `schedule` (the group's lr) and whose `weight_decay`, if it has one, is decoupled
and times the lr; `check(prefix)` refuses bad knob values with one ConfigError line. Everything
else is optional and has its default here; docs/extending.md ("An optimizer") says when to
override each, and tests/test_optimizer_contract.py checks every registered optimizer against
this class and runs the guide's example through the per-optimizer matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import optax


@dataclass(frozen=True)
class Optimizer:
    """The base of every optimizer dataclass (see the module docstring)."""

    # Shared knob: decoupled weight decay also on the token/position embeddings (hidden matrices and
    # an untied head always decay; biases and norm gains never, unless a group override says so).
    decay_embeddings: bool = False

    # The knobs `optimizer.groups.<group>.<knob>` may set, the same for every group (see group_knobs).
    GROUP_KNOBS: ClassVar[tuple[str, ...]] = ("lr",)
    # Float knobs used in Python arithmetic while the step is traced, so they stay compile-time
    # constants instead of becoming step arguments (optimizer/arguments.py).
    CONSTANT_KNOBS: ClassVar[tuple[str, ...]] = ()
    # An int knob that follows the run's length (AdEMAMix's warmup): a step argument, and a comparison
    # gives every run of the optimizer its largest budget so branches stay exact.
    RUN_LENGTH_KNOB: ClassVar[str | None] = None
    # False: the optimizer needs no lr cooldown (its own averaging: Schedule-Free); a comparison's
    # branches then keep the trunk's constant lr.
    COOLDOWN: ClassVar[bool] = True
    # A reason optimizer.cautious=true / optimizer.hyperball=true cannot apply to it (None: they can).
    CAUTIOUS_UNSUPPORTED: ClassVar[str | None] = None
    HYPERBALL_UNSUPPORTED: ClassVar[str | None] = None
    # model.mup: the exponent p of the hidden group's lr factor (base/width)^p (optimizer/mup.py: 1 for
    # Adam-type updates, 0 for an already width-invariant one); None: no known muP rule (the run's
    # header says so). A property where it depends on the knobs (Muon's shape_scale).
    MUP_HIDDEN_LR_POWER: ClassVar[float | None] = None
    # diagnostics(group, group_state, params[, grads]) -> {stat: scalar}: what its state says, logged as
    # optim/<group>/<stat> (optimizer/diagnostics.py); None: no diagnostics of its own.
    diagnostics: ClassVar[Callable[..., dict] | None] = None
    # eval_params(params, opt_state) -> the params to evaluate, sample and export when they are not the
    # ones the step trains (Schedule-Free's average x); None: the trained params.
    eval_params: ClassVar[Callable[[Any, Any], Any] | None] = None

    def check(self, prefix: str) -> None:
        """Refuse a bad knob value with one ConfigError line naming `{prefix}.<knob>` (default: none)."""

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        """The optax update of parameter group `group`, `schedule` its lr."""
        raise NotImplementedError(f"{type(self).__name__}.transform(group, schedule)")

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """The knobs a group may override; an optimizer whose groups run different algorithms (Muon:
        Newton–Schulz on `hidden`, AdamW elsewhere) names them per group, so a knob the group would
        ignore is refused."""
        return tuple(self.GROUP_KNOBS)

    def group_knob_hint(self, group: str, knob: str) -> str | None:
        """The fix to print when `optimizer.groups.<group>.<knob>` is a knob only other groups take."""
        return None

    def default_group_lr(self, group: str, base_lr: float) -> float:
        """A group's peak lr when no override sets it (Muon: its AdamW groups get `adam_lr`)."""
        return base_lr

    def hessian_due(self, opt_state) -> Any:
        """None (the default): the update reads no Hessian estimate, and the train step computes none
        (its program is the one it was before this member existed). Otherwise a bool scalar of
        `opt_state` (traceable): on the steps it is true the train step makes ONE Hutchinson estimate
        z ⊙ (H z) of the whole model's loss and passes it as `tx.update(..., hessian_diag=...)`
        (a tree like the gradient; on other steps zeros, which the update must not read). Sophia."""
        return None

    def for_run(self, schedule_name: str, schedule: Any, total_steps: int) -> Optimizer:
        """The knobs completed and checked against the run, at validation (AdEMAMix sets its warmup
        to the run's length; Schedule-Free refuses a decaying schedule)."""
        return self
