"""The run's numeric optimizer knobs as arguments of the train step, not constants in it.

Why: jax compiles a Python float as a constant of the program, so two runs that differ only in
their lr, warmup, budget or weight decay compiled two programs, and a comparison of a hundred
small runs spent most of its time compiling (issue: "a comparison spends its time training").
With these knobs passed as float32 scalars, every run of one optimizer on one model shape traces
the same program: in-process jax reuses its executables and across processes the persistent
compilation cache finds them.

What is lifted (`lift`) and put back (`bind`):
  * `schedule`: every int or float field of the lr_config dataclass (lr, min_lr, warmup, decay,
    const, max_steps...), and `schedule_steps` (the length the schedule decays over);
  * `optimizer`: every field of the optimizer's dataclass annotated `float` (b1, b2, eps,
    weight_decay, adam_lr, ...) and its `RUN_LENGTH_KNOB` (an int that follows train.max_steps),
    except those it names in `CONSTANT_KNOBS` (used in Python arithmetic at trace time, e.g.
    AdEMAMix's float64 half-life of b3, or whose value changes the algorithm, e.g. Shampoo's
    precondition_b2 of 1, a sum instead of an EMA);
  * `groups`: the float overrides of `optimizer.groups.<group>.<knob>`, with the same exception;
  * `clip`: train.gradient_clip_val when set (None and 0 stay "no clipping": a structural choice).
Zeros stay constants (code may skip a zero knob's work: no weight decay, no warmup), and so do
the optimizer's other ints (Newton–Schulz steps, preconditioning intervals), bools and strings:
they change the program's structure.

`bind(o, clip, values)` returns the OptimizerConfig (and clip) with those values in place of the
numbers, so the same builders (`schedule.build`, `make_optimizer`, the lr metrics) run on float32
tracers inside the step and on Python floats outside it. A builder must therefore not branch in
Python on a lifted knob (tests/test_step_arguments.py builds every registered optimizer and
schedule from tracers, so one that does fails there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from optimizer.schedules import Constant

Values = dict[str, Any]  # a pytree of Python floats (outside the step) or float32 scalars (inside it)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _liftable(value) -> bool:
    """A non-zero number. A zero stays a constant: code may skip the work of a zero knob (no weight
    decay, no warmup), and the step and the code outside it must build the same optimizer state."""
    return _is_number(value) and value != 0


def _float_annotated(field: dataclasses.Field) -> bool:
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return annotation.replace(" ", "").split("|")[0] == "float"


def optimizer_knobs(hparams) -> tuple[str, ...]:
    """The knobs of an optimizer dataclass that enter the step as arguments: its float fields and the
    one that follows the run's length (`RUN_LENGTH_KNOB`, an int: AdEMAMix's warmup), less CONSTANT_KNOBS."""
    constant, run_length = set(hparams.CONSTANT_KNOBS), hparams.RUN_LENGTH_KNOB
    return tuple(f.name for f in dataclasses.fields(hparams)
                 if (_float_annotated(f) or f.name == run_length) and f.name not in constant
                 and _liftable(getattr(hparams, f.name)))


def schedule_knobs(schedule) -> tuple[str, ...]:
    """The knobs of an lr_config dataclass that enter the step as arguments: its non-zero numbers."""
    return tuple(f.name for f in dataclasses.fields(schedule) if _liftable(getattr(schedule, f.name)))


def lift(o, clip: float | None) -> Values:
    """The numeric knobs of `o` (an OptimizerConfig) and the clip, as Python floats."""
    constant = set(o.hparams.CONSTANT_KNOBS)
    values = {
        "schedule": {k: float(getattr(o.schedule, k)) for k in schedule_knobs(o.schedule)},
        "schedule_steps": float(o.schedule_steps),
        "optimizer": {k: float(getattr(o.hparams, k)) for k in optimizer_knobs(o.hparams)},
        "groups": {g: {k: float(v) for k, v in knobs.items() if k not in constant and _liftable(v)}
                   for g, knobs in o.group_overrides.items()},
    }
    if clip:
        values["clip"] = float(clip)
    return values


def bind(o, clip: float | None, values: Values):
    """(o, clip) with `values` (what `lift` gave, or float32 tracers of it) in place of their numbers."""
    schedule = dataclasses.replace(o.schedule, **values["schedule"])
    hparams = dataclasses.replace(o.hparams, **values["optimizer"])
    groups = {g: {**knobs, **values["groups"].get(g, {})} for g, knobs in o.group_overrides.items()}
    bound = dataclasses.replace(o, schedule=schedule, hparams=hparams, group_overrides=groups,
                                schedule_steps=values["schedule_steps"])
    return bound, values.get("clip", clip)


def canonical(o):
    """`o` (an OptimizerConfig) as the step program that serves the most runs is built from: a
    `constant` schedule as the trapezoid it equals on every step of the run (schedules.Constant.
    as_trapezoid), so a comparison's constant-lr trunks and its cooldown branches (trapezoid, the
    default decay shape) trace one program and compile it once. The lrs are the same bit for bit;
    the run's own config (its yaml, the header's schedule name) keeps `constant`."""
    if type(o.schedule) is not Constant:
        return o
    schedule, steps = o.schedule.as_trapezoid(o.schedule_steps)
    return dataclasses.replace(o, schedule_name="trapezoid", schedule=schedule, schedule_steps=steps)


def known_zero(value) -> bool:
    """`value` is a Python number equal to 0. A knob the step takes as an argument is never known to
    be zero (its program must serve every value): code that skips work for a zero knob asks this."""
    return _is_number(value) and value == 0


def clipping(clip) -> bool:
    """train.gradient_clip_val clips: set and non-zero. A traced clip is (`lift` passes only those)."""
    return clip is not None and not known_zero(clip)


def as_arguments(values: Values) -> Values:
    """The values as the step's arguments: Python floats, which jit passes as weakly typed float32
    scalars (weak, as a constant is, so a knob meeting a bfloat16 array, a clip scaling bfloat16
    gradients, leaves it bfloat16 instead of promoting it to float32). Not device arrays made
    ahead: jax.device_put checks a multi-process value for equality across processes, and its check
    fails on a Python float."""
    import jax

    return jax.tree.map(float, values)
