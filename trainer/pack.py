"""Packed runs: up to N runs that trace one step program train as the lanes of one vmapped step.

Why: a comparison's small runs leave most of the machine idle between dispatches; runs of one
optimizer and shape that differ only in the knobs the step takes as arguments (lr, schedule,
budget, weight decay, seed: optimizer/arguments.py) run the same program, so N of them can run as
one `vmap` of it over (state, knobs) with one shared batch (a comparison feeds every run the same
batches). compare/pack.py decides which runs may train together; this module trains them.

Each member is built exactly as its own run would be (train_jax.build_trainer: initialised, or
restored from its checkpoint) and keeps its own hooks (train_jax.make_hooks: its logging, metrics
file, evaluations, checkpoints and divergence check), run on a member's view of the pack's step:
its state and metrics are sliced out of the stacked ones when a hook first reads them. A member
whose hooks raise an EqtrainError (the divergence rule's TrainingError, say) ends there as its
run would, and is masked out: no more hooks for it (its lane keeps computing: vmap lanes are
independent). Not per member: early stopping (members would end at different steps: refused).

XLA:CPU's YNNPACK reduce fusion (jaxlib 0.10.2) miscomputes vmapped backward passes past 32,768
batched elements (docs/performance.md, "Vmapped backward passes on XLA:CPU"): on a CPU a pack
refuses to run unless XLA_FLAGS holds YNN_FLAG (scripts/compare.py sets it before JAX starts).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import models
import train_jax
from optimizer import diagnostics
from trainer import hooks as H
from trainer import process_cache as shared
from trainer.header import announce
from trainer.resume import merge_config, resume_source
from utils.checkpoint.signals import Preempted, StopSignals
from utils.checkpoint.storage import step_path
from utils.config import RunConfig, to_dict, validate
from utils.errors import ConfigError, EqtrainError
from utils.logging.messages import warn
from utils.parallel import mesh as meshlib
from utils.xla_workarounds import YNN_FLAG, has_ynn_flag


def check_backend() -> None:
    """Refuse a pack on XLA:CPU without the YNNPACK workaround (its vmapped gradients would be wrong)."""
    if jax.default_backend() == "cpu" and not has_ynn_flag(os.environ):
        raise ConfigError(f"pack>1 on a CPU needs XLA_FLAGS={YNN_FLAG} set before JAX starts (XLA:CPU's "
                          "vmapped gradients are wrong without it: docs/performance.md); scripts/compare.py sets it, "
                          "or use pack=1")


def check(run: RunConfig) -> None:
    """What a run may not do as a pack member: one ConfigError line naming the knob."""
    if run.model.moe.on and run.model.moe.capacity_factor is None:
        raise ConfigError("pack>1 with dropless MoE (model.moe.capacity_factor=null): its ragged_dot cannot be "
                          "vmapped; set model.moe.capacity_factor or pack=1")
    if run.train.early_stopping.patience:
        raise ConfigError("pack>1 with train.early_stopping.patience: members would stop at different steps of one "
                          "program; set train.early_stopping.patience=0 or pack=1")


def stack(trees: Sequence[Any]) -> Any:
    """The members' pytrees with each array stacked on a new leading axis (non-arrays: the first's)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs) if eqx.is_array(xs[0]) else xs[0], *trees)


def stack_args(args: Sequence[Any]) -> Any:
    """The members' knobs (optimizer/arguments.py's Python floats) as float32 arrays of shape [N]."""
    return jax.tree.map(lambda *xs: jnp.asarray(np.asarray(xs, np.float32)), *args)


def weak(args: Any) -> Any:
    """A lane's knobs weakly typed, as the Python floats a single run passes are (optimizer/arguments.py's
    as_arguments: a knob meeting bfloat16 stays bfloat16)."""
    from jax._src.lax import lax as lax_internal  # the one public-API gap: no public way to mark a value weak

    return jax.tree.map(lambda a: lax_internal._convert_element_type(a, np.dtype(a.dtype), weak_type=True), args)


@eqx.filter_jit
def lane(tree: Any, i: jax.Array) -> Any:
    """Member `i`'s slice of a stacked pytree (one program for every i: `i` is an argument)."""
    return jax.tree.map(lambda x: x[i] if eqx.is_array(x) else x, tree)


@dataclass
class PackedStep:
    """A TrainStep's function vmapped over (state, knobs), the batch shared: one program per variant and N."""

    fn: Callable  # TrainStep.fn: step(state, batch, args, logging=...)
    traces: list = field(default_factory=lambda: [0])  # packed programs traced (so compiled or loaded) so far
    jitted: dict = field(default_factory=dict)  # logging flag -> jitted vmapped step

    def __call__(self, states_N, batch, args_N, logging: bool):
        if logging not in self.jitted:
            def one(state, batch, args):
                self.traces[0] += 1  # runs only while jax traces
                return self.fn(state, batch, weak(args), logging=logging)
            vmapped = eqx.filter_vmap(one, in_axes=(eqx.if_array(0), None, eqx.if_array(0)))
            self.jitted[logging] = eqx.filter_jit(vmapped)
        return self.jitted[logging](states_N, batch, args_N)


def packed_step(step, n: int) -> PackedStep:
    """The packed program of a shared TrainStep for `n` members: built once per comparison process."""
    if step.fn is None:
        raise ConfigError("this run's step was built without its function (a caller's own step): pack=1")
    return shared.remember("packed_step", (id(step.fn), n), lambda: (step.fn, PackedStep(step.fn)))[1]


class Pulled:
    """A packed step's metrics ({name: [N] device array}), pulled to the host once, when a member first reads one."""

    def __init__(self, metrics: dict):
        self.metrics, self.host = metrics, None

    def get(self) -> dict:
        if self.host is None:
            self.host = {k: np.asarray(v) for k, v in jax.device_get(self.metrics).items()}
        return self.host


class MemberMetrics(Mapping):
    """Member i's view of a Pulled: what LoopContext.pull and .values read."""

    def __init__(self, pulled: Pulled, i: int):
        self.pulled, self.i = pulled, i

    def __getitem__(self, name):
        return self.pulled.get()[name][self.i]

    def __iter__(self):
        return iter(self.pulled.metrics)

    def __len__(self):
        return len(self.pulled.metrics)


class MemberContext(H.LoopContext):
    """A member's LoopContext: its state is sliced out of the pack's stacked state when a hook first reads it."""

    def __init__(self, pack: Pack, index: int, *args, **kwargs):
        self._pack, self._index, self._state = pack, index, None
        super().__init__(*args, **kwargs)

    @property
    def state(self):
        if self._state is None:
            self._state = lane(self._pack.states, jnp.asarray(self._index, jnp.int32))
        return self._state

    @state.setter
    def state(self, value):
        self._state = value


OFF_THE_CLOCK = {"time/eval_sec", "time/save_sec"}  # what a member's off-the-clock hooks (hooks.py) record


@dataclass
class Member:
    index: int
    run: RunConfig
    run_dir: str
    source: Any
    trainer: Any = None
    hooks: H.Hooks | None = None
    ctx: MemberContext | None = None
    error: EqtrainError | None = None


class Pack:
    states: Any = None  # the members' stacked TrainStates


def prepare(cfg, run_dir: str) -> tuple[RunConfig, Any]:
    """(the run's config, its checkpoint source): train_jax.train's boundary, member by member."""
    config_dict = to_dict(cfg)
    run = validate(config_dict)
    check(run)
    source = resume_source(run.checkpoint, warn)
    if source is not None:
        run = validate(merge_config(source, config_dict, run.checkpoint, warn))
    return run, source


def train_pack(configs: Sequence[Any], run_dirs: Sequence[str],
               on_end: Callable[[int, EqtrainError | None], None] = lambda i, e: None) -> list[dict | EqtrainError]:
    """Train the runs `configs` (composed as train_jax.train takes them; run i into run_dirs[i]) as one
    pack: per member its last metrics, or the EqtrainError it ended with (then also `on_end(i, error)`
    at once; `on_end(i, None)` when it finished). Raises Preempted after every live member saved."""
    check_backend()
    members: list[Member] = []
    began = H.clock()
    with shared.sharing():
        for i, (cfg, run_dir) in enumerate(zip(configs, run_dirs)):
            try:
                run, source = prepare(cfg, run_dir)
                member = Member(i, run, run_dir, source)
                member.trainer = train_jax.build_trainer(run, source)
                member.run = member.trainer.run
            except EqtrainError as e:
                member = Member(i, None, run_dir, None, error=e)
                on_end(i, e)
            members.append(member)
        live = [m for m in members if m.error is None]
        if not live:
            return [m.error for m in members]
        return _train(members, live, on_end, began)


def _train(members: list[Member], live: list[Member], on_end, began: float) -> list[dict | EqtrainError]:
    first = live[0]
    step = first.trainer.train_step
    for m in live[1:]:
        if m.trainer.train_step.fn is not step.fn:
            raise ConfigError(f"{m.run_dir} and {first.run_dir} do not share one step program: they cannot be packed")
    starts = {int(m.trainer.state.step) for m in live}
    ends = {min(m.run.train.max_steps, int(m.trainer.state.step) + (m.run.checkpoint.num_steps or
                                                                     m.run.train.max_steps)) for m in live}
    if len(starts) > 1 or len(ends) > 1:
        raise ConfigError(f"pack members start at steps {sorted(starts)} and end at {sorted(ends)}: they must agree")
    start, end = starts.pop(), ends.pop()
    if first.trainer.mesh.devices.size > 1:
        raise ConfigError(f"pack>1 trains on one device; this run's mesh has {first.trainer.mesh.devices.size}: pack=1")
    pack = Pack()
    results: dict[int, Any] = {m.index: m.error for m in members if m.error is not None}
    if start >= end:
        for m in live:
            results[m.index] = dict(m.source.manifest.get("metrics", {})) if m.source else {}
            on_end(m.index, None)
        return [results[m.index] for m in members]
    pack.states = stack([m.trainer.state for m in live])
    args = stack_args([m.trainer.train_step.args for m in live])
    fn = packed_step(step, len(live))
    ck = first.run.checkpoint

    def fail(m: Member, e: EqtrainError) -> None:
        """Member m ends with `e` (recorded at once); its lane goes on computing, unread."""
        m.error = e
        results[m.index] = e
        if m.hooks is not None:
            with contextlib.suppress(Exception):  # a pending save of it still finishes; its own error is `e`
                m.hooks.close()
        m.trainer.data.close()
        on_end(m.index, e)

    with StopSignals(catch_interrupt=ck.save_on_interrupt) if ck.save else contextlib.nullcontext() as stop_signals:
        try:
            for m in live:  # as train_jax.run_training starts a run
                t = m.trainer
                num_params = models.count_params(t.state.model)
                announce(m.run, t.state, t.mesh, t.data, m.run_dir, num_params, m.source)
                m.ctx = MemberContext(pack, live.index(m), start, end, t.state, t.data.train, eval_view=t.eval_view)
                m.ctx.add({**diagnostics.state_bytes_metric(t.state.opt_state), "data/fingerprint": t.data.fingerprint,
                           **t.data.info, "time/device": jax.devices()[0].device_kind, "model/params": num_params})
                try:
                    m.hooks = train_jax.make_hooks(m.run, t, m.run_dir, stop_signals, m.source)
                except EqtrainError as e:
                    fail(m, e)
                    continue
                m.ctx.add({"time/startup_sec": H.clock() - began})
            for m in live:
                if m.error is None:
                    m.ctx.state = None  # from here on, sliced from the pack's stacked state
                    _run_hooks(m, fail)
            _loop(pack, fn, args, live, first, start, end, fail)
        finally:
            for m in live:
                if m.error is None and m.hooks is not None:
                    m.hooks.close()
                    m.trainer.data.close()
        stopped = [m for m in live if m.error is None and m.ctx.stop]
        if stopped:
            m = stopped[0]
            raise Preempted(m.ctx.stop, m.ctx.step, step_path(m.run.checkpoint.save_path, m.ctx.step))
    for m in live:
        if m.error is None:
            results[m.index] = m.ctx.last
            on_end(m.index, None)
    return [results[m.index] for m in members]


def _run_hooks(m: Member, fail: Callable) -> None:
    try:
        m.hooks.run(m.ctx)
    except EqtrainError as e:
        fail(m, e)


def _loop(pack: Pack, fn: PackedStep, args, live: list[Member], first: Member, start: int, end: int,
          fail: Callable) -> None:
    """train_jax.train_loop for the pack: one batch (every member's iterator advances alike), one dispatch,
    then each live member's hooks on its view."""
    batch_sharding, log_every = meshlib.batch_sharding(first.trainer.mesh, 1), first.run.logging.log_every
    for step in range(start + 1, end + 1):
        alive = [m for m in live if m.error is None]
        if not alive:
            return
        batch = None
        for m in alive:
            got = m.ctx.fetch(lambda m=m: next(m.trainer.data.train))
            batch = got if batch is None else batch
        batch = meshlib.put_batch(batch, batch_sharding)
        logging_step = step % log_every == 0 or step == end
        traces, t0 = fn.traces[0], time.perf_counter()
        pack.states, metrics = fn(pack.states, batch, args, logging_step)
        compile_sec = time.perf_counter() - t0 if fn.traces[0] > traces else 0.0
        pulled = Pulled(metrics)
        for m in alive:
            m.ctx.advance(step, None, MemberMetrics(pulled, m.ctx._index))
            m.ctx.compile_sec = compile_sec
            _run_hooks(m, fail)
        alive = [m for m in live if m.error is None]
        if any(OFF_THE_CLOCK & m.ctx.record.keys() for m in alive):  # one member's evaluation or save is not
            for m in alive:  # the others' training time either: every member's clock restarts after them all
                for hook in m.hooks.hooks:
                    hook.restart_clock(m.ctx)
        if any(m.ctx.stop for m in alive):
            stop = next(m.ctx.stop for m in alive if m.ctx.stop)
            for m in alive:
                m.ctx.stop = m.ctx.stop or stop
                try:
                    m.hooks.stop(m.ctx)  # the checkpointer saves
                except EqtrainError as e:
                    fail(m, e)
            return
