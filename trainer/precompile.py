"""The train step's variants compiled ahead of time, in a background thread, while the run does
its other start-up work (the baseline evaluation, its samples), so the first steps do not wait
for compilations the machine could have done meanwhile.

Why threads: XLA releases the GIL while it compiles, and a start-up is mostly one busy thread
(Python, or one XLA compilation), so a second core sits idle.

Why one thread, the variants one after the other (plain first, as the loop needs them): XLA:CPU
compiles a program's kernels with LLVM in one process-wide pool of as many threads as the
machine has cores (cpu_compiler.cc, `GetCompilationThreadPool`), first come first served. Two
compilations side by side do not finish sooner than one after the other; they share that pool,
so the variant the loop needs first finishes later, and the start-up's own compilations (the
evaluation's, the sampler's) queue behind both. Measured on the 2-core VM (the default run,
`compile_cache=false`, 2026-11-24): the first logged step came 0.45 s sooner with one thread
(10.33–10.79 s after start, 3 runs) than with two (10.60–11.36 s), and the sampler's program,
queued behind both variants, took 2.2–3.1 s to compile instead of 0.3 s.

Why the step still works unchanged: a background thread runs `jitted.lower(...).compile()` on the
arguments' shapes, which fills the same in-memory caches jax's own first call would (its trace,
its lowering, its executable), so the first real call finds the program and only dispatches it.
`TrainStep.__call__` waits for a variant's thread before calling it (a call racing an unfinished
compilation would compile the program a second time). A compilation that fails in the
background is dropped: the real call then compiles (and raises) exactly as it would have.

Why abstract arguments: the first step donates the state's buffers while the other variant may
still be lowering; `ShapeDtypeStruct`s (shape, dtype, sharding, weak type) give the same trace
as the arrays and hold no buffers.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import numpy as np

from trainer import flops
from utils.parallel import mesh as meshlib


def abstract(tree: Any) -> Any:
    """Every array of `tree` as a ShapeDtypeStruct with its sharding and weak type (jit's trace key)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
                        if isinstance(x, jax.Array) else x, tree)


def example_batch(val, accum_steps: int, batch_size: int, mesh) -> Any:
    """The abstract global batch the train loop will place: this process's rows read from the
    validation windows (the same row layout as the training windows: an int32 token array, or a
    dict with the loss mask and segment ids), shaped (accum_steps, batch_size / processes, window)
    and placed like the loop places a batch (meshlib.put_batch)."""
    rows = batch_size // jax.process_count()
    local = val.get(np.zeros((accum_steps, rows), np.int64))
    return abstract(meshlib.put_batch(local, meshlib.batch_sharding(mesh, 1)))


def variants_needed(start: int, end: int, log_every: int) -> tuple[bool, ...]:
    """The `logging` flags of the variants the loop calls for steps start+1..end (a step is a
    logging one at every log_every-th step and at `end`), in the order it first calls them."""
    steps = range(start + 1, end + 1)
    first = [s % log_every == 0 or s == end for s in steps[:log_every + 1]]  # both kinds show up by here
    return tuple(dict.fromkeys(first))


def compile_ahead(trainer, start: int, end: int) -> None:
    """Start compiling the variants `trainer`'s loop will call for steps start+1..end (a
    trainer.trainer.Trainer; train_jax.run_training calls this before the start hooks).

    CPU only: a GPU compilation autotunes its kernels on the device, which the evaluation running
    beside it would disturb (the timings it picks kernels by, the memory it needs); there the
    first call compiles, as before. So does a step function without `precompile` (a test's wrapper).

    The CPU's matmul peak (MFU's denominator, measured once per cache_dir) is taken first: measured
    beside the compilations it read 209 GFLOP/s instead of 507 on 2 cores, and the cached figure
    would have doubled every later run's logged MFU."""
    if trainer.mesh.devices.flat[0].platform != "cpu" or not hasattr(trainer.train_step, "precompile"):
        return
    run = trainer.run
    flops.peak_flops(run.train.compute_dtype, run.cache_dir)  # cached in cache_dir: Throughput reads it
    batch = example_batch(trainer.data.val, run.dataset.accum_steps, run.dataset.batch_size, trainer.mesh)
    trainer.train_step.precompile(trainer.state, batch, variants_needed(start, end, run.logging.log_every))


class Background:
    """Compilations running in threads, each collected once by name (`wait`)."""

    def __init__(self):
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[Any, concurrent.futures.Future] = {}

    def start(self, name: Any, compile_fn) -> None:
        if name in self._pending:  # already compiling
            return
        if self._pool is None:  # non-daemon: the interpreter exits after a running compilation ends; one worker:
            # the variants in the order they are needed (the module docstring)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqtrain-compile")
        self._pending[name] = self._pool.submit(compile_fn)

    def pending(self, name: Any) -> bool:
        return name in self._pending

    def wait(self, name: Any) -> None:
        """Until `name`'s compilation (if one is pending) has ended. Its failure is dropped: the
        caller's own call then compiles, and raises, as it would without a background compilation."""
        future = self._pending.pop(name, None)
        if future is None:
            return
        concurrent.futures.wait([future])
        if not self._pending:  # every compilation collected: let the idle workers go
            self._pool.shutdown(wait=False)
            self._pool = None
