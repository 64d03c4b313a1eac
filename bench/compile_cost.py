"""What a run's first start-up spends compiling: every program it compiles, one at a time.

    python bench/compile_cost.py                                    # the default run
    python bench/compile_cost.py logging.log_callback_data=false    # without the diagnostics
    python bench/compile_cost.py logging.optim_diagnostics=false    # the aux-state hook without the optimizer's
    python bench/compile_cost.py model=gpt_bench dataset.batch_size=16

Arguments are Hydra overrides of conf/config.yaml, so the programs are exactly the ones
`train_jax.py` compiles: the initial state (`build`), the evaluation (`eval_sums`), the sampler
(`_next_token`), and the train step's variants (`counted`: the plain one, then the logging one
when some metric is computed on logging steps only). The persistent compilation cache is off
(`compile_cache=false`), so every program compiles.

Each is compiled with nothing else running: the figures are the CPU time a first run spends on
them, which a real run overlaps with its evaluation and samples (trainer/precompile.py). On a
small CPU that overlap cannot hide them: XLA:CPU compiles the kernels of every program in one
process-wide pool with a thread per core, and the evaluation and the steps want the same cores
(docs/performance.md, "The default run"). Times per program (jax.monitoring's compile events):
trace (Python builds the jaxpr), lower (jaxpr to StableHLO) and XLA (optimisation and LLVM code
generation). Programs under 50 ms are summed in one row.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from hydra import compose, initialize_config_dir
from jax import monitoring

import train_jax as T
from models.sample import sampler
from trainer import hooks as H
from trainer import precompile
from utils.config import validate

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "xla"}
PROGRAMS = {"build": "initial state (model init, optimizer state)", "eval_sums": "evaluation",
            "_next_token": "sampler (one token)", "counted": "train step"}
SMALL = 0.05  # seconds: a program under this (all three phases) goes into the "small programs" row


class Recorder:
    """Compile events in the order they come, one row per compiled program: {name, trace, lower, xla}."""

    def __init__(self):
        self.rows: list[dict] = []
        self._open: dict[str, dict] = {}  # program name -> its row until its XLA compile is recorded

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        phase = EVENTS.get(event)
        if phase is None:
            return
        name = str(kwargs.get("fun_name", "?"))
        name = name[4:-1] if name.startswith("jit(") else name
        row = self._open.setdefault(name, {"name": name, "trace": 0.0, "lower": 0.0, "xla": 0.0})
        row[phase] += duration
        if phase == "xla":
            self.rows.append(self._open.pop(name))


def label(name: str, seen: collections.Counter, variants: int) -> str:
    seen[name] += 1
    if name == "counted" and variants == 2:
        return "train step, " + ("plain variant" if seen[name] == 1 else "logging variant")
    return PROGRAMS.get(name, name)


@contextlib.contextmanager
def every_program_compiled():
    """The persistent compilation cache off, also one the environment set (JAX_COMPILATION_CACHE_DIR):
    a program read from it compiles nothing. As it was afterwards."""
    from jax._src import compilation_cache  # JAX settles on a cache at its first compilation: ask again

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, overrides = parser.parse_known_args(argv)
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        run = validate(compose("config", overrides=[*overrides, "compile_cache=false"]))
    recorder = Recorder()
    monitoring.register_event_duration_secs_listener(recorder)
    try:
        with every_program_compiled():
            variants = compile_all(run)
    finally:
        monitoring.unregister_event_duration_listener(recorder)
    report(run, recorder.rows, variants, overrides)


def compile_all(run) -> int:
    """Every program a run's start-up compiles, one after another; the number of step variants."""
    H.evaluation_step.cache_clear()  # a fresh start-up's: not one this process already traced
    trainer = T.build_trainer(run)  # compiles the initial state's program
    run, model = trainer.run, trainer.state.model
    if not run.train.skip_validation:
        trainer.evaluate(model)
    sample = sampler(trainer.tokenizer, jax.random.PRNGKey(run.random_seed), run.train.sample_temperature,
                     run.context_length, run.objective.generate)
    sample(model, run.train.sample_prompt, 1)
    step = trainer.train_step
    variants = 1 if step.plain is step.logging else 2
    batch = precompile.example_batch(trainer.data.val, run.dataset.accum_steps, run.dataset.batch_size, trainer.mesh)
    step.precompile(trainer.state, batch, (False, True))  # one after the other, in a background thread
    step.wait()
    trainer.data.close()
    return variants


def report(run, rows: list[dict], variants: int, overrides: list[str]) -> None:
    print(f"{jax.devices()[0].device_kind} x {len(jax.devices())} | model {run.config_dict['model']['name']} | "
          f"optimizer {run.config_dict['optimizer']['name']} | overrides: {' '.join(overrides) or '(none)'}")
    print(f"{'program':<45} {'trace s':>8} {'lower s':>8} {'XLA s':>8} {'total s':>8}")
    seen: collections.Counter = collections.Counter()
    small = {"trace": 0.0, "lower": 0.0, "xla": 0.0}
    count = 0
    for row in rows:
        total = row["trace"] + row["lower"] + row["xla"]
        if total < SMALL:
            count += 1
            for k in small:
                small[k] += row[k]
            continue
        print(f"{label(row['name'], seen, variants):<45} {row['trace']:8.2f} {row['lower']:8.2f} {row['xla']:8.2f} "
              f"{total:8.2f}")
    print(f"{f'{count} small programs (each under {SMALL * 1e3:.0f} ms)':<45} {small['trace']:8.2f} "
          f"{small['lower']:8.2f} {small['xla']:8.2f} {sum(small.values()):8.2f}")
    totals = {k: float(np.sum([r[k] for r in rows])) for k in ("trace", "lower", "xla")}
    print(f"{'all programs':<45} {totals['trace']:8.2f} {totals['lower']:8.2f} {totals['xla']:8.2f} "
          f"{sum(totals.values()):8.2f}")


if __name__ == "__main__":
    main()
