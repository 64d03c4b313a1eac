"""What orthogonalising sharded matrices costs: the train step of Muon, NorMuon and Dion against
AdamW's on 8 forced host devices, every hidden matrix split (fsdp 8, or tensor 2 x fsdp 4).

    python bench/sharded_orthogonalisation.py                       # gpt_tiny, fsdp8 and tensor2-fsdp4
    python bench/sharded_orthogonalisation.py --layouts fsdp8 --rounds 2 model=gpt_bench

Per optimizer and layout: the compiled plain step's temporary memory per device (XLA's
memory_analysis().temp_size_in_bytes: what the step allocates beyond its arguments and outputs;
a gathered matrix, a Newton–Schulz iterate, Dion's P and R live there), its optimizer state per
device, and the median step time. The optimizers are timed in alternating order, forward then
backward, `--rounds` times, each time `--steps` steps after a warm-up, and the median of all is
reported, so a drift of the shared VM's speed falls on every optimizer alike. Trailing arguments
are Hydra overrides. The 8 "devices" share the host's cores: the times compare what each
optimizer adds under a layout (its gathers, its per-block work), not scaling.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from loaders.tokenizers import ByteTokenizer
from utils.config import resolve_vocab, validate
from utils.parallel import mesh as meshlib
from utils.parallel.layout import device_bytes

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
LAYOUTS = {"fsdp8": (1, 8, 1), "tensor2-fsdp4": (1, 4, 2)}
OPTIMIZERS = ("adamw", "muon", "normuon", "dion")


def build(name: str, layout: str, overrides: list[str]):
    """(step closure, temp bytes per device, optimizer state bytes per device) of one optimizer on one layout."""
    data, fsdp, tensor = LAYOUTS[layout]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        run = validate(compose("config", overrides=[*overrides, f"optimizer={name}", f"parallel.data={data}",
                                                    f"parallel.fsdp={fsdp}", f"parallel.tensor={tensor}"]))
    mesh = meshlib.make_mesh(data, fsdp, run.dataset.batch_size, tensor=tensor)
    run = resolve_vocab(run, ByteTokenizer.vocab_size)  # synthetic bytes: no corpus needed
    _, _, state, step = T.init_training(run, mesh)
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    batch = meshlib.put_batch(np.random.default_rng(0).integers(0, 256, shape, dtype=np.int32),
                              meshlib.batch_sharding(mesh, 1))
    compiled = step.plain.lower(state, batch, step.args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    opt_bytes = device_bytes(state.opt_state)
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(holder["state"], batch, logging=False)
        return metrics

    jax.block_until_ready(one_step())  # warm-up (the compiled program is cached by then)
    return one_step, temp, opt_bytes


def timed(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="forward + backward passes over the optimizers")
    args, overrides = parser.parse_known_args()
    overrides = ["model=gpt_tiny", "dataset.batch_size=8", *overrides]
    names = args.optimizers.split(",")
    assert len(jax.devices()) == 8, jax.devices()
    for layout in args.layouts.split(","):
        built = {name: build(name, layout, overrides) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for order in (names, names[::-1]):
                for name in order:
                    times[name] += timed(built[name][0], args.steps)
        base_t = statistics.median(times["adamw"]) if "adamw" in times else None
        base_m = built["adamw"][1] if "adamw" in built else None
        print(f"\n{layout} (data, fsdp, tensor = {LAYOUTS[layout]}), {overrides}")
        print(f"{'optimizer':>10} | {'temp/device':>12} | {'vs AdamW':>10} | {'opt state/device':>16} | "
              f"{'step (median)':>13} | vs AdamW")
        for name in names:
            _, temp, opt_bytes = built[name]
            step_s = statistics.median(times[name])
            extra_m = f"{(temp - base_m) / 2**20:+9.2f} MiB" if base_m is not None else ""
            extra_t = f"{step_s / base_t - 1:+6.1%}" if base_t else ""
            print(f"{name:>10} | {temp / 2**20:8.2f} MiB | {extra_m:>10} | {opt_bytes / 2**20:12.2f} MiB | "
                  f"{step_s * 1e3:10.1f} ms | {extra_t}", flush=True)


if __name__ == "__main__":
    main()
