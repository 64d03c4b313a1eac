"""What each optimizer adds to a train step: step time per optimizer beside forward+backward.

    python bench/optimizer_cost.py                      # gpt_bench, every registered optimizer
    python bench/optimizer_cost.py --optimizers adamw,muon --steps 5 model=gpt_tiny

Optimizer cost = step time - forward+backward time (a jitted value_and_grad on the same batch);
the table also gives each step relative to AdamW's. Trailing arguments are Hydra overrides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import train_jax as T  # noqa: E402
from models.gpt import cross_entropy  # noqa: E402
from optimizer import OPTIMIZERS  # noqa: E402
from utils import mesh as meshlib  # noqa: E402
from utils.config import validate  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def median_time(fn, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default=",".join(sorted(OPTIMIZERS)))
    args, overrides = parser.parse_known_args()
    overrides = ["model=gpt_bench", "dataset.batch_size=16", *overrides]
    variants = [(name, [f"optimizer={name}"]) for name in args.optimizers.split(",")]
    if "shampoo" in OPTIMIZERS and "shampoo" in args.optimizers.split(","):
        variants = [v for v in variants if v[0] != "shampoo"]
        variants += [(f"shampoo(every {k})", ["optimizer=shampoo", f"optimizer.precondition_every={k}"])
                     for k in (1, 10)]

    rows, fwd_bwd = [], None
    for label, extra in variants:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            run = validate(compose("config", overrides=[*overrides, *extra]))
        mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)
        run = T.resolve_vocab(run, T.tokenizers.byte_tokenizer()) if run.model.vocab_size is None else run
        _, _, state, step = T.init_training(run, mesh)
        shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
        batch = meshlib.put_batch(np.random.default_rng(0).integers(0, 256, shape, dtype=np.int32),
                                  meshlib.batch_sharding(mesh, 1))
        if fwd_bwd is None:
            grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, b: cross_entropy(m, b, None, jnp.float32)[0]))
            fwd_bwd = median_time(lambda: grad(state.model, batch[0]), args.steps)
            print(f"forward+backward: {fwd_bwd * 1e3:.1f} ms")

        holder = {"state": state}

        def one_step():
            holder["state"], metrics = step(holder["state"], batch)
            return metrics

        t0 = time.perf_counter()
        jax.block_until_ready(one_step())
        compile_s = time.perf_counter() - t0
        seconds = median_time(one_step, args.steps)
        rows.append((label, seconds, compile_s))
        print(f"{label:>20}: step {seconds * 1e3:8.1f} ms | optimizer {(seconds - fwd_bwd) * 1e3:7.1f} ms "
              f"({(seconds - fwd_bwd) / fwd_bwd:+6.1%} of fwd+bwd) | compile {compile_s:5.1f} s", flush=True)

    base = dict((r[0], r[1]) for r in rows).get("adamw")
    if base:
        print("\nrelative to the AdamW step:")
        for label, seconds, _ in rows:
            print(f"{label:>20}: {seconds / base - 1:+6.1%}")


if __name__ == "__main__":
    main()
