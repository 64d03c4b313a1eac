"""Alternated train-step timings of config variants in ONE process, with their compile times: the
fair way to decide a default such as `model.scan_blocks` or `model.remat` on a shared machine.

    python bench/step_variants.py model=gpt_tiny dataset.batch_size=16 logging.log_callback_data=false \
        --variant=base= --variant=unrolled=model.scan_blocks=false --compile-rounds 3 --pairs 6

Arguments other than the flags are Hydra overrides every variant shares (as in bench/step_speed.py:
the step timed is the plain step `train_jax.py` compiles, on a fixed synthetic batch).
`--variant=NAME=OVERRIDES` (comma-separated overrides on top of the shared ones; empty = the shared
config itself) repeats; the first is the baseline. Every variant is built and compiled
`--compile-rounds` times, the rounds alternated (A B, then B A), and the median first-step time is
its "compile" (every round compiles: XLA's persistent cache is turned on by train_jax.py's command
line, utils/cli.py, never by `build_trainer`, and each round's step is a new jitted function). Then
bench/pairs.py alternates the steps: k steps of each per pair, the order flipping each pair.
Printed per variant: its median step, its speed against the baseline (median over pairs of the
per-pair ratio, > 1 = faster), and per step its page faults and user/kernel CPU time (the kernel's
share is mostly the zeroing of freshly mapped pages: XLA:CPU maps its temporary buffer anew each
step). Like step_speed.py it first re-executes itself with glibc's huge pages (utils/host_memory.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import host_memory

if __name__ == "__main__":  # not in main(): a test calls it in pytest's process
    host_memory.use_huge_pages(__file__)

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from utils import versions
from utils.config import validate
from utils.parallel import mesh as meshlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairs as pairlib  # bench/pairs.py (bench/ holds scripts, not a package)

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def parse_variants(specs: list[str], shared: list[str]) -> dict[str, list[str]]:
    """{name: the shared overrides + its own} of `--variant=NAME=OVERRIDES` specs, in the given order;
    a spec without a name or a repeated name stops the bench with one line."""
    variants = {}
    for spec in specs:
        name, eq, extra = spec.partition("=")
        if not name or not eq:
            sys.exit(f"step_variants.py: --variant={spec!r} must be NAME=OVERRIDES (e.g. --variant=unrolled="
                     "model.scan_blocks=false; --variant=base= for the shared config)")
        if name in variants:
            sys.exit(f"step_variants.py: two variants are named {name!r}: give each its own name")
        variants[name] = [*shared, *(o for o in extra.split(",") if o)]
    return variants


def build_variant(overrides: list[str]):
    """(step() running one plain step to completion on a fixed synthetic batch, its first call's seconds)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        run = validate(compose("config", overrides=overrides))
    trainer = T.build_trainer(run)
    step_fn = functools.partial(trainer.train_step, logging=False)
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    tokens = np.random.default_rng(0).integers(0, trainer.tokenizer.vocab_size, shape, dtype=np.int32)
    batch = meshlib.put_batch(tokens, meshlib.batch_sharding(trainer.mesh, 1))
    box = {"state": trainer.state}

    def step():
        box["state"], metrics = step_fn(box["state"], batch)
        jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    step()  # the first call traces and compiles
    return step, time.perf_counter() - t0


def per_step_costs(step, n: int = 4) -> tuple[float, float, float, float]:
    """(page faults, user CPU s, kernel CPU s, wall s) per step, over `n` steps."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(n):
        step()
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    return ((r1.ru_minflt - r0.ru_minflt) / n, (r1.ru_utime - r0.ru_utime) / n, (r1.ru_stime - r0.ru_stime) / n,
            wall / n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=OVERRIDES")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--k", type=int, default=3, help="steps of each variant per pair")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile-rounds", type=int, default=1,
                        help="build and compile every variant this many times, alternated; the median is reported")
    parser.add_argument("--quiet", type=float, default=0.0, metavar="SHARE",
                        help="before each pair wait (up to 120 s) until other processes use under SHARE of the CPUs")
    args, shared = parser.parse_known_args(argv)
    variants = parse_variants(args.variant, shared)
    print(f"machine: {versions.describe()}")
    print(f"shared overrides: {' '.join(shared)} | host allocator: "
          f"{'glibc huge pages' if host_memory.TUNABLE in os.environ.get('GLIBC_TUNABLES', '') else 'default'}")
    steps, compiles = {}, {name: [] for name in variants}
    for r in range(max(1, args.compile_rounds)):  # alternated: a slow spell of the machine hits every variant
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            steps[name], seconds = build_variant(variants[name])
            compiles[name].append(seconds)
    for name, overrides in variants.items():
        faults, user, kernel, wall = per_step_costs(steps[name])
        print(f"{name:>12}: compile (first step) {statistics.median(compiles[name]):.2f} s "
              f"({' '.join(f'{c:.2f}' for c in compiles[name])}) | per step: {faults:,.0f} page faults, "
              f"CPU user {user * 1e3:.0f} ms + kernel {kernel * 1e3:.0f} ms over {wall * 1e3:.0f} ms wall "
              f"| {' '.join(overrides[len(shared):]) or '(shared config)'}", flush=True)
    shares = []
    gate = (lambda: shares.append(pairlib.wait_for_quiet(args.quiet, 120.0))) if args.quiet else None
    results = pairlib.run_pairs(steps, args.pairs, k=args.k, warmup=args.warmup, before_pair=gate)
    if shares:
        print(f"other processes' share of the CPUs before each pair: {' '.join(f'{x:.0%}' for x in shares)}")
    names, base = list(steps), next(iter(steps))
    for i, r in enumerate(results, 1):
        print(f"pair {i}: " + " | ".join(f"{n} {r[n] * 1e3:6.1f} ms" for n in names))
    for n in names:
        rs = pairlib.ratios(results, n, base)
        print(f"{n:>12}: step {statistics.median(r[n] for r in results) * 1e3:7.1f} ms median | vs {base}: "
              f"{statistics.median(rs):.3f}x (pairs {min(rs):.3f}-{max(rs):.3f}; > 1 = faster) "
              f"| compile {statistics.median(compiles[n]):.2f} s")


if __name__ == "__main__":
    main()
