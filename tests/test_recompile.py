"""No recompilation after an evaluation or a resume (issue 25): each train step variant compiles
once per run. A second compilation of a variant (the evaluation handing back arrays with other
shardings, a restored state laid out unlike the step's output, a weakly typed step counter) would
cost a whole compile time in the middle of training.

Compilations are counted from JAX's own log (`jax_log_compiles`: one "Compiling <name>" record per
program lowered), which fires on every jit cache miss whether or not the persistent cache then
finds the executable on disk. It is switched on for the whole process, not with the thread-local
`jax.log_compiles()` context: the run compiles its step variants in a background thread
(trainer/precompile.py), and those count too."""

from __future__ import annotations

import collections
import logging

import jax
from helpers import compose_config

import train_jax

RUN = ("model.vocab_size=null", "train.max_val_steps=1", "optimizer/lr_config=constant", "logging.log_every=2",
       "train.val_freq=2", "logging.log_callback_data=true", "logging.optim_diagnostics=false")


class Compilations(logging.Handler):
    """Counts JAX's "Compiling <name> ..." records by name while it is attached."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()
        self.threads: collections.defaultdict = collections.defaultdict(list)  # name -> the threads that compiled it

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.counts[message.split()[1]] += 1  # "jit(<name>)"
            self.threads[message.split()[1]].append(record.threadName)


def count_compilations(run):
    logger = logging.getLogger("jax._src.interpreters.pxla")
    handler, level, logged = Compilations(), logger.level, jax.config.jax_log_compiles
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        run()
    finally:
        jax.config.update("jax_log_compiles", logged)
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler


def test_the_step_variants_compile_once_across_evaluations_and_a_resume(tmp_path):
    """Segment 1: steps 1-4 of 8 (checkpoint.num_steps=4), an evaluation every 2 steps (between
    steps), both step variants (the aux hook on), saved at its end. Segment 2, the same command,
    resumes it and trains steps 5-8. In each the step (`counted`, both variants' name:
    trainer/step_metrics.compile_variants) compiles exactly twice, plain and logging variant,
    both ahead of time in a background thread (trainer/precompile.py) while the start hooks
    run, and the evaluation's program once in the first (the process keeps it: the resumed segment,
    like every later run in this process, reuses it, trainer/hooks.evaluation_step)."""
    from trainer.hooks import evaluation_step

    evaluation_step.cache_clear()  # another test of this process may have traced it
    command = (*RUN, "train.max_steps=8", "checkpoint.save=true", f"checkpoint.save_path={tmp_path / 'ck'}",
               "checkpoint.num_steps=4", "checkpoint.resume=auto", "checkpoint.async_save=false")
    segments = []
    for name in ("first", "resumed"):
        (tmp_path / name).mkdir()
        segments.append(count_compilations(lambda d=str(tmp_path / name): train_jax.train(compose_config(*command), d)))
    for compilations, evaluations in zip(segments, (1, 0)):
        counts = compilations.counts
        assert counts["jit(counted)"] == 2, sorted(counts.items())
        assert counts.get("jit(eval_sums)", 0) == evaluations, sorted(counts.items())
        assert all(t.startswith("eqtrain-compile") for t in compilations.threads["jit(counted)"]), compilations.threads
    assert '"step": 8' in (tmp_path / "resumed" / "metrics.jsonl").read_text()  # it did resume and finish
