"""What the aux-state diagnostics cost: step time and memory per logging.* flag.

    python bench/aux_cost.py                                  # gpt_bench, batch 16 (docs/performance.md's table)
    python bench/aux_cost.py model=gpt_tiny --steps 20        # quick
    python bench/aux_cost.py --only off,defaults              # a subset of the configurations

For each configuration the real train step of train_jax (both compiled variants) runs on one
fixed synthetic batch: the median time of plain steps (what most steps are) and of logging steps
(every logging.log_every-th), the compile time of both variants, the aux state's bytes (its
buffers, in parameter copies) and XLA's temporary memory for the logging variant. Arguments
other than --steps/--only are Hydra overrides of conf/config.yaml. Timings on a shared machine
are noisy: the configurations are measured in rounds, interleaved, and medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx
import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from utils.config import validate
from utils.parallel import mesh as meshlib

FLAGS = ("store_last_params", "store_last_grads", "store_past_grads", "compute_last_loss", "compute_last_grads")


def flags(on: tuple[str, ...], log: bool = True, per_layer: bool = False) -> list[str]:
    return [f"logging.log_callback_data={str(log).lower()}", f"logging.per_layer={str(per_layer).lower()}",
            *(f"logging.{f}={str(f in on).lower()}" for f in FLAGS)]


CONFIGS = {
    "off": flags((), log=False),  # log_callback_data=false: no hook at all
    "hook only": flags(()),  # log_callback_data=true, every flag off
    "store_last_params": flags(("store_last_params",)),
    "store_last_grads": flags(("store_last_grads",)),
    "store_past_grads": flags(("store_past_grads",)),
    "defaults": flags(("store_last_params", "store_last_grads", "store_past_grads")),
    "defaults + compute_last_loss": flags(("store_last_params", "store_last_grads", "store_past_grads",
                                          "compute_last_loss")),
    "defaults + compute_last_grads": flags(("store_last_params", "store_last_grads", "store_past_grads",
                                           "compute_last_grads")),
    "defaults + per_layer": flags(("store_last_params", "store_last_grads", "store_past_grads"), per_layer=True),
}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each variant per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated configuration names")
    args, overrides = parser.parse_known_args()
    overrides = ["model=gpt_bench", "dataset.batch_size=16", *overrides]
    names = args.only.split(",") if args.only else list(CONFIGS)
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

    built = {}
    for name in names:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            run = validate(compose("config", overrides=[*overrides, *CONFIGS[name]]))
        trainer = T.build_trainer(run)
        shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
        tokens = np.random.default_rng(0).integers(0, trainer.tokenizer.vocab_size, shape, dtype=np.int32)
        batch = meshlib.put_batch(tokens, meshlib.batch_sharding(trainer.mesh, 1))
        step, state = trainer.train_step, trainer.state
        param_bytes = nbytes(state.model)
        temp = step.logging.lower(state, batch, step.args).compile().memory_analysis()
        t0 = time.perf_counter()
        state, m = step(state, batch, False)
        jax.block_until_ready(m)
        state, m = step(state, batch, True)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        built[name] = {"step": step, "state": state, "batch": batch, "compile": compile_s, "plain": [],
                       "logging": [], "aux_copies": nbytes(state.metric_states) / param_bytes,
                       "temp_mib": getattr(temp, "temp_size_in_bytes", 0) / 2**20, "params": param_bytes}
        print(f"built {name}: compile {compile_s:.1f} s", flush=True)

    for _ in range(args.rounds):  # interleaved: a slow spell of the machine hits every configuration
        for name in names:
            b = built[name]
            for variant, logging in (("plain", False), ("logging", True)):
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    b["state"], m = b["step"](b["state"], b["batch"], logging)
                    jax.block_until_ready((b["state"], m))
                    b[variant].append(time.perf_counter() - t0)

    base = statistics.median(built[names[0]]["plain"])
    print(f"\n{jax.devices()[0].device_kind} | params {built[names[0]]['params'] / 2**20:.1f} MiB | "
          f"{args.rounds}x{args.steps} steps per variant | overrides: {' '.join(overrides)}")
    print(f"| configuration | plain step | vs {names[0]} | logging step | buffers (param copies) | "
          "logging-variant temp | compile (both) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        b = built[name]
        plain, logging = statistics.median(b["plain"]), statistics.median(b["logging"])
        print(f"| {name} | {plain * 1e3:.0f} ms | {plain / base - 1:+.1%} | {logging * 1e3:.0f} ms | "
              f"{b['aux_copies']:.2f} | {b['temp_mib']:.0f} MiB | {b['compile']:.1f} s |")


if __name__ == "__main__":
    main()
