"""What each optimizer costs: its update alone, and the whole train step relative to AdamW's.

    python bench/optimizer_cost.py                      # gpt_bench, every registered optimizer
    python bench/optimizer_cost.py --optimizers adamw,muon --steps 5 model=gpt_tiny

"update" times the optimizer's `tx.update` (clipping included) jitted on its own, on the
state's real shapes; "step" times the full train step (its plain variant: every step but the
one in `logging.log_every` that computes the diagnostics). Shampoo runs twice, preconditioning
every step and every 10 (its update time is then the mean over 10 consecutive updates, the
expensive one included). Sophia runs twice, its yaml's (a Hessian estimate every 10 steps: the
median step makes none) and `sophia(every 1)` (every step makes one: the estimate's step cost).
Trailing arguments are Hydra overrides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import host_memory

if __name__ == "__main__":  # the allocator `python train_jax.py` runs with (utils/host_memory.py)
    host_memory.use_huge_pages(__file__)  # first, before jax loads: the re-execution then costs ~nothing

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from loaders.tokenizers import ByteTokenizer
from optimizer import OPTIMIZERS
from utils.config import resolve_vocab, validate
from utils.parallel import mesh as meshlib

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


def measure(overrides: list[str], steps: int) -> tuple[float, float, float]:
    """(median step seconds, the optimizer update alone, the first step's compile seconds) of one
    optimizer's run config."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        run = validate(compose("config", overrides=overrides))
    mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)
    run = resolve_vocab(run, ByteTokenizer.vocab_size)  # synthetic bytes: no corpus needed
    _, tx, state, step = T.init_training(run, mesh)
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    batch = meshlib.put_batch(np.random.default_rng(0).integers(0, 256, shape, dtype=np.int32),
                              meshlib.batch_sharding(mesh, 1))

    params = eqx.filter(state.model, eqx.is_array)
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    # an update that reads a Hessian estimate (Sophia) is handed a stand-in; the step makes its own
    extra = {} if run.optimizer.hparams.hessian_due(state.opt_state) is None else {"hessian_diag": grads}
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))
    opt_state = {"s": state.opt_state}

    def ten_updates():  # ten in a row: covers Shampoo's every-10 recompute once
        for _ in range(10):
            u, opt_state["s"] = update(grads, opt_state["s"], params)
        return u

    jax.block_until_ready(update(grads, opt_state["s"], params))
    update_s = median_time(ten_updates, max(steps // 2, 2), warmup=1) / 10

    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(holder["state"], batch, logging=False)  # the variant most steps run
        return metrics

    t0 = time.perf_counter()
    jax.block_until_ready(one_step())
    compile_s = time.perf_counter() - t0
    return median_time(one_step, steps), update_s, compile_s


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
    if "sophia" in OPTIMIZERS and "sophia" in args.optimizers.split(","):  # the median step has no Hessian
        at = [v[0] for v in variants].index("sophia")  # estimate (1 in 10): `every 1` times the step with one
        variants.insert(at + 1, ("sophia(every 1)", ["optimizer=sophia", "optimizer.precondition_every=1"]))

    rows = []
    for label, extra in variants:
        seconds, update_s, compile_s = measure([*overrides, *extra], args.steps)
        rows.append((label, seconds, compile_s))
        print(f"{label:>20}: step {seconds * 1e3:8.1f} ms | update alone {update_s * 1e3:7.1f} ms "
              f"({update_s / seconds:5.1%} of the step) | compile {compile_s:5.1f} s", flush=True)

    base = dict((r[0], r[1]) for r in rows).get("adamw")
    if base:
        print("\nrelative to the AdamW step:")
        for label, seconds, _ in rows:
            print(f"{label:>20}: {seconds / base - 1:+6.1%}")


if __name__ == "__main__":
    main()
