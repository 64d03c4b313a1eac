"""The host loop's periodic jobs, each a small object with its own schedule.

The loop dispatches a step and then calls every hook due at it, in list order; a new periodic
job is one `Hook` subclass added to the run's hook list (train_jax.make_hooks), never a branch
in the loop. A hook is due at the start (`at_start`, before the first step: the baseline
evaluation), every `every` steps, and at the segment's last step (`at_end`); `due` can be
overridden for anything else. `on_stop` runs when a stop signal is agreed (the checkpointer saves),
`close` always runs when the loop ends, however it ends.

Hooks share one `LoopContext`: the step's device metrics, the values pulled or computed at this
step (`record`, what the sinks log), the latest value of every metric (`last`, what a
checkpoint's manifest keeps), and what the loop measured of this step (the wait for its batch,
the compilation its dispatch waited for). Nothing here knows the model: hooks that need it get a
function.

A hook declares what it puts into `record` that other hooks read (`produces`) and what it reads
(`needs`): `Hooks` checks at construction that every producer of a need runs before the hook
that needs it, and names both when one does not (a need nobody produces is fine: e.g. no
Evaluation hook, so no val/loss). A hook that spends wall time that is not training (an
evaluation, sampling, a save) says so with `off_the_clock` (read after each call: the
checkpointer sets it when it saved): the hooks that time training are told (`restart_clock`)
once it has run.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import equinox as eqx

from trainer.step_metrics import UPDATE_NORM
from utils.checkpoint import signals
from utils.checkpoint.storage import step_path
from utils.errors import DataError, TrainingError
from utils.logging.messages import say
from utils.logging.sinks import Sinks
from utils.parallel import mesh as meshlib

# The loop's clock (a seam: tests drive it to check the throughput arithmetic exactly).
clock = time.perf_counter


# What Throughput puts into `record` on logging steps: this step's device metrics, pulled.
STEP_VALUES = "the step's metrics"


@dataclass
class LoopContext:
    start: int  # the step the segment starts from (0, or a checkpoint's)
    end: int  # its last step
    state: Any  # the TrainState after `step`
    data: Any  # the train iterator (its state_dict goes into checkpoints)
    step: int = 0
    metrics: dict | None = None  # this step's metrics, device arrays (None before the first step)
    record: dict[str, float] = field(default_factory=dict)  # values of this step, logged by the sinks
    last: dict[str, float] = field(default_factory=dict)  # latest value of every metric so far
    stop: str | None = None  # a stop signal every process agreed on
    finished: str | None = None  # why the run ends at this step, before `end` (early stopping)
    pulled: bool = False  # this step's metrics are in `record` already
    data_wait: float = 0.0  # seconds the loop waited for this step's batch
    compile_sec: float = 0.0  # seconds this step's dispatch waited for a compilation
    # state -> the model to evaluate, sample and rank (optimizer.eval_view: Schedule-Free's average;
    # trainer/weight_average.py: train.weight_average's);
    # None: the state's own model
    eval_view: Callable[[Any], Any] | None = None
    _eval_model: Any = field(default=None, init=False, repr=False)  # eval_view's model of this step, made once

    def __post_init__(self) -> None:
        self.step = self.start

    @property
    def ending(self) -> bool:
        """The segment's last step: `end`, or the step early stopping ends the run at."""
        return self.step == self.end or self.finished is not None

    def advance(self, step: int, state: Any, metrics: dict) -> None:
        self.step, self.state, self.metrics, self.record, self.pulled = step, state, metrics, {}, False
        self._eval_model = None

    def eval_model(self) -> Any:
        """The model evaluation, samples and the best checkpoint's ranking use: the state's own,
        unless the optimizer evaluates another point (`eval_view`)."""
        if self.eval_view is None:
            return self.state.model
        if self._eval_model is None:
            self._eval_model = self.eval_view(self.state)
        return self._eval_model

    def add(self, values: dict[str, float]) -> None:
        self.record.update(values)
        self.last.update(values)

    def pull(self) -> None:
        """This step's metrics into `record`: the only device sync of a training step."""
        if self.metrics is not None and not self.pulled:
            self.add({k: float(v) for k, v in self.metrics.items()})
            self.pulled = True

    def values(self, names: Sequence[str]) -> dict[str, float]:
        return {k: float(self.metrics[k]) for k in names if k in self.metrics}

    def fetch(self, next_batch: Callable[[], Any]) -> Any:
        """The next batch, the time waited for it in `data_wait`."""
        began = clock()
        batch = next_batch()
        self.data_wait = clock() - began
        return batch

    def dispatch(self, step_fn, batch, logging: bool) -> tuple[Any, dict]:
        """`step_fn(state, batch, logging)` dispatched (it returns before the device is done); a call
        that traced and compiled a variant, or waited for its compilation in the background
        (TrainStep.precompile), made the host wait: `compile_sec`. (A step function without
        `pending`, e.g. a test's wrapper, compiles on its calls only.)"""
        pending = getattr(step_fn, "pending", lambda logging: False)(logging)
        compiled, began = step_fn.compiled(), clock()
        out = step_fn(self.state, batch, logging)
        self.compile_sec = clock() - began if pending or step_fn.compiled() > compiled else 0.0
        return out


class Hook:
    """A periodic job of the loop. One whose state a resume needs defines `state_dict() -> dict` (strict
    JSON: it goes into every checkpoint's manifest, so inf or NaN as null) and takes that dict back as
    its constructor's `saved` argument (None in a fresh run, and whatever its initial state saved);
    tests/test_hooks.py round-trips every such hook from its initial state."""

    every: int | None = None
    at_start: bool = False
    at_end: bool = False
    produces: tuple[str, ...] = ()  # keys of `record` this hook adds that other hooks read
    needs: tuple[str, ...] = ()  # keys of `record` this hook reads: their producers must run first
    off_the_clock: bool = False  # its wall time is not training (the throughput clock restarts after it)

    def due(self, ctx: LoopContext) -> bool:
        if ctx.step == ctx.start:
            return self.at_start
        return bool(self.every and ctx.step % self.every == 0) or (self.at_end and ctx.ending)

    def __call__(self, ctx: LoopContext) -> None:
        raise NotImplementedError

    def restart_clock(self, ctx: LoopContext) -> None:
        """Time spent from here on until the next step is not training (an off-the-clock hook ran)."""

    def on_stop(self, ctx: LoopContext) -> None:
        pass

    def close(self) -> None:
        pass


class Hooks:
    """A run's hooks in the order they run after each step, checked: a hook that needs a value
    runs after the hook that produces it."""

    def __init__(self, hooks: Sequence[Hook]):
        self.hooks = list(hooks)
        for i, hook in enumerate(self.hooks):
            for key in hook.needs:
                later = [h for h in self.hooks[i + 1:] if key in h.produces]
                if later:
                    raise ValueError(f"hook {type(hook).__name__} needs {key!r}, which {type(later[0]).__name__} "
                                     f"produces after it: put {type(later[0]).__name__} before "
                                     f"{type(hook).__name__} in the hook list")

    def run(self, ctx: LoopContext) -> None:
        for hook in self.hooks:
            if hook.due(ctx):
                hook(ctx)
                if hook.off_the_clock:
                    for other in self.hooks:
                        other.restart_clock(ctx)

    def stop(self, ctx: LoopContext) -> None:
        for hook in self.hooks:
            hook.on_stop(ctx)

    def close(self) -> None:
        """Every hook's close, even when one fails: a pending checkpoint write must finish."""
        error = None
        for hook in self.hooks:
            try:
                hook.close()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others closed
                error = error or e
        if error is not None:
            raise error


VOUCHERS = ("train/loss", UPDATE_NORM)  # UPDATE_NORM: this step's update, Δ(n+1) (not trainit's update/norm, Δ(n))


def check_finite(values: dict[str, float], step: int, names: Sequence[str] = VOUCHERS) -> None:
    """Stop a diverged run before it logs on or saves: a NaN state written at an interval or on
    preemption would push good checkpoints out under max_to_keep and be resumed from. The loss
    vouches for the weights the step started from, the update's norm for the ones it produced
    (with train.skip_nonfinite a NaN loss is a skipped step, so only the update's norm counts)."""
    for name in names:
        value = values.get(name, 0.0)
        if not math.isfinite(value):
            raise TrainingError(f"{name} is {value} at step {step}: the run diverged; "
                                "lower optimizer.lr_config.lr or set train.gradient_clip_val")


class Throughput(Hook):
    """On logging steps: pull the step's metrics and add the clean step time with tokens/s and MFU
    from it, the time spent waiting for data (averaged over the steps since the last mark), the
    tokens consumed and the wall time since the run began (`elapsed` carries earlier segments' over a
    resume). Called every step: it sums the loop's per-step data waits and compilation waits itself.

    The clean step time (`time/step_sec`) is the median of the last `window` clean intervals' wall
    time per step. An interval runs from one logging step (where the metrics pull syncs with the
    device) to the next; an off-the-clock hook (an evaluation, samples, a save) restarts it once it
    has run (its own wait synced), so its time is never in one. An interval is clean unless a
    step in it waited for a compilation, and it is not the segment's first (that holds the start:
    the first dispatches, the data pipeline warming up). No clean interval yet: no step time."""

    at_start = at_end = True
    every = 1
    produces = (STEP_VALUES,)
    WINDOW = 20  # clean intervals the running median is taken over

    def __init__(self, log_every: int, tokens_per_step: int, flops_per_step: float, peak: float | None,
                 elapsed: float = 0.0, window: int = WINDOW):
        self.log_every, self.tokens_per_step = log_every, tokens_per_step
        self.flops_per_step, self.peak = flops_per_step, peak
        self.elapsed, self.began = elapsed, 0.0
        self.mark: tuple[float, int] = (0.0, 0)  # (time, step) the current interval starts from
        self.data_wait = 0.0  # seconds waited for batches since the mark
        self.compile_sec = 0.0  # seconds waited for compilations not yet logged
        self.compiled = False  # a step of the current interval waited for a compilation
        self.clean: deque[float] = deque(maxlen=window)  # seconds per step of the latest clean intervals

    def restart_clock(self, ctx: LoopContext) -> None:
        self.mark, self.data_wait, self.compiled = (clock(), ctx.step), 0.0, False

    def __call__(self, ctx: LoopContext) -> None:
        if ctx.step == ctx.start:
            self.began = clock()
            self.restart_clock(ctx)
            return
        self.data_wait += ctx.data_wait
        self.compile_sec += ctx.compile_sec
        self.compiled = self.compiled or ctx.compile_sec > 0
        if ctx.step % self.log_every and ctx.step != ctx.end:
            return
        ctx.pull()
        now, (then, step_then) = clock(), self.mark
        steps = ctx.step - step_then
        if step_then > ctx.start and not self.compiled and steps > 0:
            self.clean.append((now - then) / steps)
        if steps > 0:
            ctx.add({"time/data_wait_sec": self.data_wait / steps})
        if self.clean:
            seconds = statistics.median(self.clean)
            ctx.add({"time/step_sec": seconds, "train/tokens_per_sec": self.tokens_per_step / seconds,
                     "train/mfu": self.flops_per_step / seconds / self.peak if self.peak else float("nan")})
        ctx.add({"data/tokens": float(ctx.step * self.tokens_per_step),
                 "time/elapsed_sec": self.elapsed + now - self.began})
        if self.compile_sec:
            ctx.add({"time/compile_sec": self.compile_sec})
            self.compile_sec = 0.0
        self.mark, self.data_wait, self.compiled = (now, ctx.step), 0.0, False


def evaluate(eval_step: Callable, model: Any, batches: Iterable[tuple]) -> dict[str, float]:
    """Mean loss, perplexity and accuracy per target token over `batches`, from `eval_step(model,
    *batch)`'s weighted sums (loss, correct predictions, counted targets): padding rows weigh 0, so
    each real window counts once, and masked-out targets (chat prompts) not at all."""
    sums = [eval_step(model, *batch) for batch in batches]  # all dispatched before the first value is pulled
    loss_sum, correct_sum, targets = (sum(float(s[i]) for s in sums) for i in range(3))
    if targets == 0:
        raise DataError("the validation windows hold no target the loss counts (every loss-mask entry is 0): "
                        "check the dataset's loss mask or raise train.max_val_steps")
    loss = loss_sum / targets
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/accuracy": correct_sum / targets}


@functools.lru_cache(maxsize=8)
def evaluation_step(objective, compute_dtype: str) -> Callable:
    """`objective.eval_sums` of one batch, jitted: one per (objective, compute dtype) in a process, so
    the runs of a comparison (or of a test session) reuse its traced and compiled programs. (Here, not
    in train_jax.py: a module-level cache there would be pickled by reference to `__main__` by
    submitit's launcher.)"""
    return eqx.filter_jit(functools.partial(objective.eval_sums, compute_dtype=compute_dtype))


def evaluator(eval_step: Callable, mesh, batches: Callable[[], Iterable[tuple]]) -> Callable[[Any], dict[str, float]]:
    """model -> `evaluate` over `batches()` (host (tokens, weights) pairs), each placed on `mesh`
    with its rows split over the data axes."""
    tokens_sharding = meshlib.batch_sharding(mesh, 0)
    weights_sharding = meshlib.row_sharding(tokens_sharding)

    def placed():
        for batch_BxT1, weights_B in batches():
            yield meshlib.put_batch(batch_BxT1, tokens_sharding), meshlib.put_batch(weights_B, weights_sharding)

    return lambda model: evaluate(eval_step, model, placed())


class Evaluation(Hook):
    """Every `val_freq` steps, at each step of `val_at` (train.val_at) and at train.max_steps (not at
    a segment's end: a resumed run evaluates where an unbroken one would, so each listed step once),
    plus the untrained baseline at step 0. The values are of `ctx.eval_model()`; with `raw`
    (train.weight_average) the state's own model is evaluated too, its values logged with a `_raw`
    suffix (val/loss_raw...)."""

    produces = ("val/loss",)
    off_the_clock = True  # evaluation time is not training throughput

    def __init__(self, evaluate: Callable[[Any], dict[str, float]], val_freq: int, max_steps: int, at_start: bool,
                 val_at: Sequence[int] = (), raw: bool = False):
        self.evaluate, self.every, self.max_steps, self.at_start = evaluate, val_freq, max_steps, at_start
        self.val_at, self.raw = frozenset(val_at), raw

    def due(self, ctx: LoopContext) -> bool:
        if ctx.step == ctx.start:
            return self.at_start and ctx.start == 0
        return ctx.step % self.every == 0 or ctx.step == self.max_steps or ctx.step in self.val_at

    def __call__(self, ctx: LoopContext) -> None:
        began = clock()
        ctx.add(self.evaluate(ctx.eval_model()))
        if self.raw:
            ctx.add({f"{name}_raw": value for name, value in self.evaluate(ctx.state.model).items()})
        ctx.add({"time/eval_sec": clock() - began})


class Log(Hook):
    """Progress every step; whatever this step recorded to every sink."""

    at_start = True
    every = 1
    needs = (STEP_VALUES, "val/loss")  # logged at the step they belong to

    def __init__(self, sinks: Sinks):
        self.sinks = sinks

    def __call__(self, ctx: LoopContext) -> None:
        if ctx.step > ctx.start:
            self.sinks.advance()
        if ctx.record:
            self.sinks.log(ctx.step, ctx.record)

    def close(self) -> None:
        self.sinks.close()


class Divergence(Hook):
    """Stops the run (TrainingError) at the first logged non-finite loss or update norm; with
    train.skip_nonfinite, says when steps were skipped since the last log."""

    needs = (STEP_VALUES,)

    def __init__(self, vouchers: Sequence[str] = VOUCHERS):
        self.vouchers, self.skipped = vouchers, 0

    def due(self, ctx: LoopContext) -> bool:
        return ctx.step > ctx.start and bool(ctx.record)

    def __call__(self, ctx: LoopContext) -> None:
        check_finite(ctx.record, ctx.step, self.vouchers)
        skipped = int(ctx.record.get("train/skipped_steps", self.skipped))
        if skipped > self.skipped:
            say(f"step {ctx.step}: {skipped - self.skipped} step(s) with a non-finite gradient skipped "
                f"(train.skip_nonfinite; {skipped} in all)")
        self.skipped = skipped


class Checkpoint(Hook):
    """Saves at checkpoint.save_steps (an interval or a list), at the segment's end, at a new best
    val/loss (keep_best) and when a stop signal is agreed; each save only of a finite state.
    `saver` is a utils.checkpoint.storage.Checkpointer; `close` waits for pending asynchronous writes."""

    at_end = True
    needs = ("val/loss",)  # the best-checkpoint policy ranks by it
    off_the_clock = False  # true after a call that saved (the save synced): its time is not training

    def __init__(self, saver, save_path: str, vouchers: Sequence[str] = VOUCHERS, save_at_end: bool = True,
                 max_steps: int | None = None):
        self.saver, self.save_path, self.vouchers = saver, save_path, vouchers
        self.save_at_end, self.max_steps = save_at_end, max_steps  # checkpoint.save_at_end, train.max_steps

    def ends_here(self, ctx: LoopContext) -> bool:
        """A save at the segment's end: always, unless it is the run's end (its last step, or early
        stopping's) and checkpoint.save_at_end is false (a comparison's branch, whose checkpoint it deletes)."""
        return ctx.ending and (self.save_at_end or not (ctx.finished or ctx.step == self.max_steps))

    def due(self, ctx: LoopContext) -> bool:
        return ctx.step > ctx.start and (self.saver.due(ctx.step) or ctx.ending or "val/loss" in ctx.record)

    def __call__(self, ctx: LoopContext) -> None:
        self.off_the_clock = False
        best = "val/loss" in ctx.record and self.saver.maybe_save_best(ctx.step, ctx.state, ctx.data.state_dict(),
                                                                       ctx.last)
        if best:
            self.off_the_clock = True
            say(f"checkpoint: new best val/loss {ctx.record['val/loss']:.4f}, saving {self.save_path}/best")
        if self.saver.due(ctx.step) or self.ends_here(ctx):
            self.save(ctx, "end" if ctx.step == ctx.end else "early stop" if ctx.finished else "scheduled")

    def on_stop(self, ctx: LoopContext) -> None:
        self.save(ctx, ctx.stop)

    def save(self, ctx: LoopContext, reason: str) -> None:
        check_finite(ctx.values(self.vouchers), ctx.step, self.vouchers)
        began = clock()
        if self.saver.save(ctx.step, ctx.state, ctx.data.state_dict(), ctx.last, reason):
            ctx.add({"time/save_sec": clock() - began})  # until the arrays are off the device; files follow
            self.off_the_clock = True
            say(f"checkpoint: saving {step_path(self.save_path, ctx.step)} ({reason})")

    def close(self) -> None:
        self.saver.close()


class StopOnSignal(Hook):
    """SIGTERM/SIGUSR1 (SLURM's warning before a time limit) or Ctrl-C: every process agrees on
    the stop at a sync point, then the loop runs the hooks' on_stop (the checkpointer saves) and
    ends with signals.Preempted. At the segment's end the run is done and saved: it just ends."""

    every = 1

    def __init__(self, stop_signals: signals.StopSignals):
        self.stop_signals = stop_signals

    def __call__(self, ctx: LoopContext) -> None:
        if ctx.step < ctx.end:
            ctx.stop = signals.agree(self.stop_signals.requested, sync_point=bool(ctx.record))


class EvalSamples(Hook):
    """At each evaluation, text from fixed prompts with a fixed key, to the sinks (samples.jsonl,
    TensorBoard, wandb): how the same prompts read as training goes on. Every process samples
    (the model is sharded), only process 0's sinks write."""

    needs = ("val/loss",)
    off_the_clock = True  # sampling time is not training throughput

    def __init__(self, sample: Callable[[Any, str, int], str], prompts: Sequence[str], tokens: int, sinks: Sinks):
        self.sample, self.prompts, self.tokens, self.sinks = sample, tuple(prompts), tokens, sinks

    def due(self, ctx: LoopContext) -> bool:
        return "val/loss" in ctx.record

    def __call__(self, ctx: LoopContext) -> None:
        self.sinks.log_samples(ctx.step, [(p, self.sample(ctx.eval_model(), p, self.tokens)) for p in self.prompts])


class Sample(Hook):
    """A little generated text at the segment's end, so a run shows what it learned."""

    at_end = True

    def __init__(self, sample: Callable[[Any, str, int], str], prompt: str, tokens: int):
        self.sample, self.prompt, self.tokens = sample, prompt, tokens

    def __call__(self, ctx: LoopContext) -> None:
        say("---- sample ----\n" + self.sample(ctx.eval_model(), self.prompt, self.tokens) + "\n----------------")
