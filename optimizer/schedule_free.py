"""Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), straight from
optax.contrib.schedule_free_adamw.

It keeps three sequences: z (plain Adam-without-momentum steps), x (a running average of z, the
point to evaluate) and y = b1·x + (1 − b1)·z (where the gradient is taken). The params the train
step holds are y; evaluation, samples, the best checkpoint's ranking and exports must use x =
`optax.contrib.schedule_free_eval_params(state, y)`, which `eval_params` gives for every group
(`optimizer.eval_params` is the trainer's seam). The averaging replaces the lr decay, so a decaying
schedule is refused (`for_run`); a warmup is fine (optimizer.lr_config.warmup).

Weight decay: optax's schedule_free_adamw chains scale_by_rms -> add_decayed_weights ->
scale_by_learning_rate inside the wrapper, so z takes the decay decoupled and times the lr, at y
(as the reference implementation does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from optax.contrib import ScheduleFreeState, schedule_free_adamw, schedule_free_eval_params

from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states, is_masked, sqrt_v_stats
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError


# The state of scale_by_rms(bias_correction=True), the second moment inside schedule_free_adamw:
# its class (ScaleByRmsWithCountState) is not exported by optax, so it is taken from an instance.
# Taken lazily: building an optax state at import would start JAX's backend before
# jax.distributed.initialize (utils/parallel/mesh.py), which multi-process runs must call first.
@functools.cache
def rms_state() -> type:
    return type(optax.scale_by_rms(bias_correction=True).init({}))


def _group_eval_params(state: ScheduleFreeState, params):
    """x for the leaves of `state`'s group (its z holds arrays there, MaskedNode elsewhere), by
    optax's schedule_free_eval_params on y masked the same way; MaskedNode elsewhere."""
    masked_y = jax.tree.map(lambda y, z: z if is_masked(z) else y, params, state.z)
    return schedule_free_eval_params(state, masked_y)


def eval_params(params, opt_state):
    """`params` (y) with every Schedule-Free group's leaves replaced by its x; leaves of groups
    without a ScheduleFreeState stay y."""
    out = params
    for state in find_states(opt_state, ScheduleFreeState):
        x = _group_eval_params(state, params)
        out = jax.tree.map(lambda o, xi: o if is_masked(xi) else xi, out, x)
    return out


def decaying_schedule(schedule_name: str, schedule) -> bool:
    """Whether the lr schedule falls at some step. Judged from the knobs (validation runs no JAX):
    constant never; trapezoid/wsd only with decay > 0; piecewise_linear where a scale falls;
    any other schedule (cosine, linear, one added later) is taken to decay."""
    if schedule_name == "constant":
        return False
    if schedule_name in ("trapezoid", "wsd"):
        return schedule.decay > 0 and schedule.min_lr < schedule.lr
    if schedule_name == "piecewise_linear":
        return any(b < a for a, b in zip(schedule.scales, schedule.scales[1:]))
    return True


@dataclass(frozen=True)
class ScheduleFreeAdamW(Optimizer):
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_lr_power: float = 2.0

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)
    # The averaging stands in for an lr decay: a comparison's branches keep the constant lr
    # (compare/plan.py) instead of cooling down, which this optimizer refuses.
    COOLDOWN = False
    # optimizer.cautious masks -lr·direction and adds -lr·wd·p on the weights it updates; this
    # optimizer decays z, not the y it hands back, so the mask's decay split would be wrong.
    CAUTIOUS_UNSUPPORTED = "its weight decay acts on z, not on the weights it updates"
    # optimizer.hyperball projects the weights the step moves, y, an interpolation of z and the average
    # x: y on the sphere leaves z and x off it, and x is what is evaluated.
    HYPERBALL_UNSUPPORTED = "it moves y, an interpolation of its z and average x, which the sphere would not hold"

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2")
        check_non_negative(prefix, self, "weight_decay", "weight_lr_power")
        if self.b1 <= 0:  # x = (y - (1 - b1)·z) / b1
            raise ConfigError(f"{prefix}.b1={self.b1} must be in (0, 1): Schedule-Free divides by it")
        check_positive(prefix, self, "eps")

    def for_run(self, schedule_name: str, schedule, total_steps: int) -> "ScheduleFreeAdamW":
        del total_steps
        if decaying_schedule(schedule_name, schedule):
            raise ConfigError(
                f"optimizer/lr_config={schedule_name} decays the lr, which Schedule-Free replaces by averaging: "
                "use optimizer/lr_config=constant (optimizer.lr_config.warmup allowed), or trapezoid with "
                "optimizer.lr_config.decay=0")
        return self

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        # warmup_steps=None: the warmup is the run's schedule's (optimizer.lr_config.warmup).
        return schedule_free_adamw(schedule, warmup_steps=None, b1=self.b1, b2=self.b2, eps=self.eps,
                                   weight_decay=self.weight_decay, weight_lr_power=self.weight_lr_power)

    def eval_params(self, params, opt_state):
        return eval_params(params, opt_state)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sf_distance_rms: the RMS over the group's elements of y − x, how far the training point
        sits from the average it is evaluated at ((1 − b1)/b1 · |z − y| elementwise); and
        sqrt_v_min / _median / _max of the bias-corrected second moment (as AdamW's)."""
        states = find_states(group_state, ScheduleFreeState)
        if not states:
            return {}
        x = _group_eval_params(states[0], params)
        diffs = []
        jax.tree.map(lambda y, xi: None if is_masked(xi) else diffs.append((y - xi).astype(jnp.float32)), params, x)
        if not diffs:
            return {}
        sum_sq = sum(jnp.sum(d * d) for d in diffs)
        out = {"sf_distance_rms": jnp.sqrt(sum_sq / sum(d.size for d in diffs))}
        rms = find_states(states[0].base_optimizer_state, rms_state())
        if rms:
            out.update(sqrt_v_stats(array_leaves(rms[0].nu), rms[0].count, self.b2))
        return out
