"""The train step's variants compiled ahead of time in a background thread (trainer/precompile.py,
TrainStep.precompile; issue 25): the first calls use those programs (no second trace), they compute
exactly what the lazily compiled step computes, and a dispatch that waited for one counts the wait
as compilation time. And the diagnostics' reductions, the logging variant's extra compile time, stay
one per parameter array."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_jax as T
from trainer import aux_state, precompile
from trainer import hooks as H
from utils.parallel import mesh as meshlib

# The aux-state hook on: the step has a plain and a logging variant (two programs).
TWO_VARIANTS = ("logging.log_callback_data=true", "logging.optim_diagnostics=false")


def batches(mesh, n: int) -> list:
    rng = np.random.default_rng(0)
    return [meshlib.put_batch(rng.integers(0, 64, (1, 8, 17), dtype=np.int32), meshlib.batch_sharding(mesh, 1))
            for _ in range(n)]


def test_precompiled_variants_are_the_programs_the_calls_run(tiny_run):
    """Both variants traced in the background before any call (2 traces), and no call traces again;
    three steps (plain, logging, plain) equal, bit for bit, those of a twin step compiled lazily
    on its first calls: the same programs, so the same numbers."""
    run = tiny_run(*TWO_VARIANTS)
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    _, _, twin_state, twin = T.init_training(run, mesh)
    assert step.plain is not step.logging
    data = batches(mesh, 3)
    step.precompile(state, data[0])
    assert step.pending(False) and step.pending(True)
    step.wait()
    assert step.compiled() == 2  # both variants traced, in the background
    for batch, logging in zip(data, (False, True, False), strict=True):
        state, metrics = step(state, batch, logging)
        twin_state, twin_metrics = twin(twin_state, batch, logging)
        assert {k: float(v) for k, v in metrics.items()} == {k: float(v) for k, v in twin_metrics.items()}
    assert step.compiled() == 2 and twin.compiled() == 2  # no call traced a variant again
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(twin_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_dispatch_that_waits_for_a_background_compilation_counts_the_wait(tiny_run):
    """LoopContext.dispatch's compile_sec: the seconds the host waited for the variant's background
    compilation (here traced before the dispatch, so the trace count does not tell, and compiled
    at least 0.3 s later), then 0 for the next call of that variant."""
    run = tiny_run("logging.log_callback_data=false")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch = batches(mesh, 1)[0]
    traced = threading.Event()

    def slow_compile():
        lowered = step.logging.lower(*precompile.abstract((state, batch, step.args)))
        traced.set()
        time.sleep(0.3)
        lowered.compile()

    step.background.start(True, slow_compile)
    assert traced.wait(60) and step.compiled() == 1
    ctx = H.LoopContext(0, 2, state, data=None)
    ctx.advance(1, *ctx.dispatch(step, batch, logging=True))
    assert ctx.compile_sec >= 0.3 and step.compiled() == 1 and not step.pending(True)
    ctx.advance(2, *ctx.dispatch(step, batch, logging=True))
    assert ctx.compile_sec == 0.0 and step.compiled() == 1


def test_background_compilations_run_one_after_another_in_the_order_asked():
    """XLA:CPU's LLVM pool is shared by every compilation of the process, first come first served:
    two variants compiled side by side only delay the one the loop needs first (and the start-up's
    own programs behind them). So they run one at a time, in the order `start` was called."""
    background, events = precompile.Background(), []

    def compile_fn(name: str):
        def run():
            events.append(("start", name))
            time.sleep(0.2)  # long enough for a second worker, if there were one, to start the next
            events.append(("end", name))
        return run

    background.start(False, compile_fn("plain"))
    background.start(True, compile_fn("logging"))
    background.wait(True)
    background.wait(False)
    assert events == [("start", "plain"), ("end", "plain"), ("start", "logging"), ("end", "logging")], events


@pytest.mark.parametrize("start, end, log_every, expected", [
    (0, 300, 10, (False, True)),  # plain steps first, the logging one at step 10
    (9, 300, 10, (True, False)),  # a run resumed at step 9: step 10 logs first
    (0, 1, 10, (True,)),  # the only step is the last one, which logs
    (0, 50, 1, (True,)),  # every step logs
    (8, 11, 10, (False, True)),
    (9, 11, 10, (True,)),  # steps 10 (log_every) and 11 (the end) both log
])
def test_only_the_variants_the_loop_calls_are_compiled_ahead(start, end, log_every, expected):
    assert precompile.variants_needed(start, end, log_every) == expected


def test_the_example_batch_is_laid_out_like_the_loops_batches(tiny_run):
    """precompile.example_batch (from the validation windows) has the shape, dtype and sharding of
    what the loop places (meshlib.put_batch of the training iterator's next batch), masked rows too."""
    for overrides in ((), ("dataset.document_mask=true", "dataset.batch_size=4", "dataset.total_batch_size=8")):
        run = tiny_run(*overrides)
        mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
        docs = run.dataset.source.documents()  # the data as build_trainer makes it, no model
        data = T.init_data(run, T.init_tokenizer(run, docs[0]), docs)
        try:
            example = precompile.example_batch(data.val, run.dataset.accum_steps, run.dataset.batch_size, mesh)
            real = precompile.abstract(meshlib.put_batch(next(data.train), meshlib.batch_sharding(mesh, 1)))
        finally:
            data.close()
        assert jax.tree.structure(example) == jax.tree.structure(real)
        assert jax.tree.leaves(example) == jax.tree.leaves(real), overrides


def test_the_diagnostics_read_each_parameter_array_in_one_reduction():
    """The aux-state hook's norms and inner products (every flag on, a logging step) are one
    variadic reduction per parameter array (aux_state.leafwise), not one reduction per statistic
    and array: what the logging variant's compile time was made of. Counted in the jaxpr, so the
    count does not depend on how XLA fuses."""
    params = {"a": jnp.ones((3, 4)), "b": jnp.ones(5), "c": jnp.ones((2, 2, 2))}
    cfg = aux_state.AuxConfig(compute_last_loss=True, compute_last_grads=True)
    aux = aux_state.init(cfg, params)
    last = aux_state.LastPoint(jnp.float32(0.5), params)

    def update(aux, params):
        return aux_state.update(cfg, aux, params, params, params, jnp.float32(1.0), last, logging=True)

    primitives = [eqn.primitive.name for eqn in jax.make_jaxpr(update)(aux, params).jaxpr.eqns]
    reductions = [p for p in primitives if p.startswith(("reduce", "argm", "dot_general", "cum"))]
    assert reductions == ["reduce"] * len(params), reductions  # one variadic reduce per array, nothing else


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's measured peak (a GPU's: data sheet)")
def test_the_cpu_peak_is_measured_before_the_background_compilations_start(tiny_run, tmp_path, monkeypatch):
    """MFU's denominator, measured once per cache_dir and cached: measured while the variants compile
    on the other core it reads low (209 GFLOP/s instead of 507 on 2 cores), and every later run from
    that cache_dir logs an MFU twice too high. compile_ahead takes it first, into the cache."""
    from trainer import flops

    run = tiny_run(*TWO_VARIANTS, "model.vocab_size=null", f"cache_dir={tmp_path / 'cache'}")
    trainer = T.build_trainer(run)
    seen = []
    monkeypatch.setattr(flops, "measure_matmul_flops",
                        lambda *a, **k: seen.append(trainer.train_step.pending(False)
                                                    or trainer.train_step.pending(True)) or 1e11)
    precompile.compile_ahead(trainer, 0, run.train.max_steps)
    assert trainer.train_step.pending(False) and trainer.train_step.pending(True)  # compiling now
    trainer.train_step.wait()
    assert seen == [False]  # measured once, with nothing compiling beside it
    assert flops.peak_flops(run.train.compute_dtype, run.cache_dir) == 1e11  # cached: the hooks read it
    trainer.data.close()
