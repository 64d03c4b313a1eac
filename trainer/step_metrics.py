"""Metrics computed inside the jitted train step, from what the step already has.

One interface for every step metric (`StepMetric`, a Protocol):

    name: str | None                   # its state's key in TrainState.metric_states; None = stateless
    logging_only: bool                 # computed only in the logging variant of the step
    init(params) -> state              # the state at step 0 (params: the model's float arrays)
    update(state, inputs, logging) -> (state, metrics)

`inputs` (`StepInputs`) is what the step has: the TrainState it started from (`state`, x_n) and
the one it produced (`new_state`: the optimizer state this update was computed with and left,
the new weights), the averaged gradients, the updates, the loss's aux outputs stacked over
micro-batches (`aux["loss"]` is loss_A), and `loss_at(model, with_grads)`, this step's batch
evaluated at another point with the step's own dropout keys. Values stay on the device; the host
pulls them on logging steps. A metric's state lives in the TrainState under its name, shards like
the parameters, and is saved in checkpoints, so a resumed run's metrics continue exactly. The
aux-state hook (trainer/aux_state.py, `AuxHook`) is the stateful one every run can switch on.

A stateless metric is one function: `FnMetric(fn)` with `fn(state, grads, updates, aux) -> dict`,
given the step's starting state, or with `after_update=True` the state it produced (Adam's
bias-corrected second moment is then the denominator this update divided by, Shampoo's clock
counts this update); what describes the step being taken from where it started (`train/lr`: the
schedule at the step's own index) reads the starting state.

A metric marked `logging_only` costs nothing on other steps: the step is compiled in two
variants and the loop calls the one that computes it only on logging steps (a second
compilation, so it is only made when some metric asks for it; a stateful metric always asks, as
its `update` gets `logging`, unless it says `same_when_logging = True`: its update ignores the flag,
as the weight average's does, trainer/weight_average.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from optimizer import diagnostics
from trainer import loss_scale, precompile

MetricFn = Callable[[Any, Any, Any, dict], dict[str, jax.Array]]


@dataclass(frozen=True)
class StepInputs:
    """What one step hands its metrics (see the module docstring)."""

    state: Any  # the TrainState the step started from
    new_state: Any  # the TrainState it produced (metric_states not yet updated)
    grads: Any  # averaged over micro-batches, before clipping
    updates: Any  # what the optimizer adds to the weights
    aux: dict  # the loss's aux outputs, stacked over micro-batches
    loss_at: Callable[[Any, bool], tuple[jax.Array, Any]]  # (model, with_grads) -> (mean loss, grads or None)
    batch: Any = None  # this step's batch, micro-batches stacked on axis 0 (a token array or the loaders' dict)


@runtime_checkable
class StepMetric(Protocol):
    name: str | None
    logging_only: bool

    def init(self, params) -> Any: ...

    def update(self, state, inputs: StepInputs, logging: bool) -> tuple[Any, dict[str, jax.Array]]: ...


@dataclass(frozen=True)
class FnMetric:
    """A stateless metric: `fn(state, grads, updates, aux) -> dict`."""

    fn: MetricFn
    logging_only: bool = False
    after_update: bool = False  # fn's `state` is the state the step produced, not the one it started from
    name = None

    def init(self, params) -> None:
        return None

    def update(self, state, inputs: StepInputs, logging: bool) -> tuple[None, dict[str, jax.Array]]:
        return None, self.fn(inputs.new_state if self.after_update else inputs.state, inputs.grads, inputs.updates,
                             inputs.aux)


def optimizer_diagnostics(hparams: Any, overrides: dict[str, dict[str, float]] | None = None,
                          clip: float | None = None) -> FnMetric:
    """The optimizer's own `optim/...` metrics (optimizer/diagnostics.py `optimizer_metrics`) as a
    metric of the logging variant, read from the state the step produced: the optimizer state
    this update was computed with and left, and the step's gradient clipped at `clip`
    (train.gradient_clip_val) as make_optimizer's chain clips it."""
    return FnMetric(lambda state, grads, updates, aux: diagnostics.optimizer_metrics(
        hparams, state.opt_state, eqx.filter(state.model, eqx.is_array), overrides, grads, clip),
        logging_only=True, after_update=True)


def stateful(metrics: Sequence[StepMetric]) -> list[StepMetric]:
    """The metrics that keep a state, each under its own name (checked: names are unique)."""
    out = [m for m in metrics if m.name is not None]
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"step metrics share a state name: {names}")
    return out


def init_states(metrics: Sequence[StepMetric], params) -> dict[str, Any]:
    """TrainState.metric_states at step 0: {name: its init(params)} for the stateful metrics."""
    return {m.name: m.init(params) for m in stateful(metrics)}


def all_finite(tree) -> jax.Array:
    """One boolean: every element of every leaf is finite (apply_if_finite's own test)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def loss(state, grads, updates, aux) -> dict[str, jax.Array]:
    return {"train/loss": aux["loss"].mean()}


UPDATE_NORM = "train/update_norm"


def norms(state, grads, updates, aux) -> dict[str, jax.Array]:
    """Global L2 norms of the gradient (before clipping) and of the update this step applies,
    Δ(n+1) (trainit's `update/norm` is the previous one, Δ(n): trainer/aux_state.py). The update
    norm also vouches, before every save, that the weights a step produced are finite
    (trainer.hooks.check_finite)."""
    return {"train/grad_norm": optax.tree.norm(grads), UPDATE_NORM: optax.tree.norm(updates)}


def learning_rates(schedule: optax.Schedule, by_group: dict[str, optax.Schedule], groups: Iterable[str]) -> MetricFn:
    """train/lr (the run's schedule) and train/lr/<group> for each group the model has (a tied
    head has no group of its own), at the step being taken."""
    present = {g: by_group[g] for g in sorted(set(groups)) if g in by_group}  # a frozen base has no lr

    def lrs(state, grads, updates, aux) -> dict[str, jax.Array]:
        return {"train/lr": schedule(state.step), **{f"train/lr/{g}": s(state.step) for g, s in present.items()}}

    return lrs


def skipped_steps(state, grads, updates, aux) -> dict[str, jax.Array]:
    """Steps whose non-finite gradient optax.apply_if_finite skipped, this one included."""
    return {"train/skipped_steps": state.opt_state.total_notfinite + (~all_finite(grads)).astype(jnp.int32)}


def router(state, grads, updates, aux) -> dict[str, jax.Array]:
    """A Mixture-of-Experts model's router (models/moe.py: the loss's aux["moe"], per micro-batch):
    moe/load_balance_loss, moe/router_z_loss, moe/dropped_fraction (means over the MoE layers and
    the micro-batches) and, per MoE block i, moe/load/<i>/min and /max: the smallest and largest
    fraction of token-slots routed to one expert (1/num_experts each when balanced). Nothing for a
    dense model."""
    if "moe" not in aux:
        return {}
    moe = aux["moe"]
    out = {f"moe/{name}": moe[name].mean() for name in ("load_balance_loss", "router_z_loss", "dropped_fraction")}
    for layer, load_AxE in moe["load"].items():
        out.update({f"moe/load/{layer}/min": load_AxE.mean(0).min(), f"moe/load/{layer}/max": load_AxE.mean(0).max()})
    return out


def expert_loads() -> FnMetric:
    """logging.per_layer (logging steps only): every expert's load, moe/load/<block>/<expert>."""

    def expert_load_vectors(state, grads, updates, aux) -> dict[str, jax.Array]:
        loads = aux["moe"]["load"] if "moe" in aux else {}
        return {f"moe/load/{layer}/{e}": load_E[e] for layer, load_AxE in loads.items()
                for load_E in [load_AxE.mean(0)] for e in range(load_E.shape[0])}

    return FnMetric(expert_load_vectors, logging_only=True)


def defaults(schedule: optax.Schedule, by_group: dict[str, optax.Schedule], groups: Iterable[str],
             skip_nonfinite: bool = False) -> list[StepMetric]:
    """What every run logs: train/loss, the norms, the learning rates (and the skipped steps; under
    float16 compute the loss scale; an MoE model's router statistics)."""
    metrics = [FnMetric(loss), FnMetric(norms), FnMetric(learning_rates(schedule, by_group, groups)),
               FnMetric(loss_scale.metric), FnMetric(router)]
    return metrics + ([FnMetric(skipped_steps)] if skip_nonfinite else [])


def compute(metrics: Sequence[StepMetric], inputs: StepInputs, logging: bool
            ) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """(the next metric_states, the metrics): every metric due (all when `logging`, else those not
    logging-only) updated from its state in `inputs.state.metric_states`."""
    states, out = dict(inputs.state.metric_states), {}
    for metric in metrics:
        if logging or not metric.logging_only:
            new, values = metric.update(states.get(metric.name), inputs, logging)
            if metric.name is not None:
                states[metric.name] = new
            out.update(values)
    return states, out


@dataclass(frozen=True)
class TrainStep:
    """A compiled step in two variants: `logging` also computes the metrics marked logging-only.
    They are one function when no metric is, so nothing compiles twice. `traces` counts the
    programs traced (and so compiled, or read from the compilation cache) so far: the step
    function bumps it each time jax traces it, which jax does once per variant and argument
    layout, so a count that grows after the first calls is a recompilation."""

    plain: Callable
    logging: Callable
    traces: list = dataclasses.field(default_factory=lambda: [0])  # one mutable cell
    # variants compiling ahead of time (`precompile`), by their `logging` flag
    background: precompile.Background = dataclasses.field(default_factory=precompile.Background)
    args: Any = None  # the step's third argument, bound: the run's knobs (optimizer/arguments.py) as arrays
    called: set = dataclasses.field(default_factory=set)  # variants called so far (by any run sharing this step)
    fn: Callable | None = None  # the unjitted `step(state, batch, args, logging=...)`: what trainer/pack.py vmaps

    def __call__(self, state, batch, logging: bool = True):
        self.background.wait(self._variant(logging))  # a call racing its compilation would compile it again
        out = (self.logging if logging else self.plain)(state, batch, self.args)
        self.called.add(self._variant(logging))
        return out

    def with_args(self, args) -> TrainStep:
        """This step (its jitted programs, trace count and called variants shared) bound to another run's
        knobs: the next run of a comparison that shares it (trainer/process_cache.py)."""
        return dataclasses.replace(self, args=args, background=precompile.Background())

    def compiled(self) -> int:
        """Programs compiled so far: grows on the call that traced and compiled a variant (or, with
        `precompile`, in the background thread that did)."""
        return self.traces[0]

    def precompile(self, state, batch, variants: Sequence[bool] = (False, True)) -> None:
        """Start compiling the variants (their `logging` flags, in the order they are needed) in
        background threads for arguments shaped like `state` and `batch` (arrays or
        ShapeDtypeStructs); the call of a variant waits for its compilation (trainer/precompile.py)."""
        args = precompile.abstract((state, batch, self.args))
        # A variant an earlier run sharing this step called is compiled already: its call dispatches at once.
        for logging in dict.fromkeys(self._variant(v) for v in variants if self._variant(v) not in self.called):
            fn = self.logging if logging else self.plain
            self.background.start(logging, lambda fn=fn: fn.lower(*args).compile())

    def wait(self) -> None:
        """Block until every background compilation has ended (a benchmark's timer, a test)."""
        for logging in (False, True):
            self.background.wait(logging)

    def pending(self, logging: bool) -> bool:
        """The call of this variant will collect a background compilation (and wait if it is still running)."""
        return self.background.pending(self._variant(logging))

    def _variant(self, logging: bool) -> bool:
        return True if self.plain is self.logging else bool(logging)


def compile_variants(step: Callable, metrics: Sequence[StepMetric], split: bool = False, args: Any = None,
                     **jit_kwargs) -> TrainStep:
    """`step(state, batch, args, logging)` jitted once per variant it needs (`logging` is static);
    `split` asks for both variants whatever the metrics (the aux-state hook computes values only
    when logging). `args` (device arrays: the knobs of optimizer/arguments.py, or None) is bound:
    the TrainStep is called as `step(state, batch, logging)`."""
    traces = [0]

    def counted(*call_args, logging: bool):
        traces[0] += 1  # runs only while jax traces: once per compiled program
        return step(*call_args, logging=logging)

    logging_step = jax.jit(functools.partial(counted, logging=True), **jit_kwargs)
    if not split and not any(m.logging_only or (m.name is not None and not getattr(m, "same_when_logging", False))
                             for m in metrics):
        return TrainStep(logging_step, logging_step, traces, args=args, fn=step)
    return TrainStep(jax.jit(functools.partial(counted, logging=False), **jit_kwargs), logging_step, traces,
                     args=args, fn=step)
