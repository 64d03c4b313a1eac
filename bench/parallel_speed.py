"""Sharding strategies side by side on 8 forced CPU devices: step time and per-device memory.

    python bench/parallel_speed.py                                  # gpt_bench, batch 16 (docs/performance.md's table)
    python bench/parallel_speed.py --small                          # gpt_tiny: the same table in ~a minute
    python bench/parallel_speed.py --strategies data8,zero1 --steps 10
    python bench/parallel_speed.py --strategies single,data8 logging.log_callback_data=false

Each strategy is one mesh of parallel.data x fsdp x tensor (+ parallel.shard_optimizer_state for
ZeRO-1) over the 8 host devices that XLA_FLAGS=--xla_force_host_platform_device_count=8 creates
(set here, before jax is imported; an existing XLA_FLAGS is kept and appended to). For each: the
first call of the plain train step of train_jax (trace + compile + one step), the median of
--steps timed steps on one fixed random batch (each ended by a device sync, after one untimed
warm-up step), tokens/s, and the bytes of parameters and optimizer state held by one device
(utils.parallel.layout.device_bytes), also as a share of their 1-device total: FSDP and ZeRO-1 hold ~1/8
of the optimizer state, data parallelism all of it. Arguments other than the flags below are Hydra
overrides of conf/config.yaml. Strategies are built first and then timed in --rounds interleaved
rounds, so a slow spell of a shared machine hits them alike.

Caveat: the 8 "devices" share the host's cores (2 on the CI-like VM), so the step times compare
the layouts (their collectives and per-device shapes), not scaling: no strategy can be faster
than one device here.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import datetime
import shlex
import statistics
import time

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from models import count_params
from utils import versions
from utils.config import resolve_vocab, validate
from utils.parallel import mesh as meshlib
from utils.parallel.layout import device_bytes

# name -> (label, parallel.data, parallel.fsdp, parallel.tensor, parallel.shard_optimizer_state)
STRATEGIES = {
    "data8": ("data 8", 8, 1, 1, False),
    "fsdp8": ("fsdp 8", 1, 8, 1, False),
    "data4-fsdp2": ("data 4 x fsdp 2", 4, 2, 1, False),
    "zero1": ("ZeRO-1 (data 8 + shard_optimizer_state)", 8, 1, 1, True),
    "tensor2-data4": ("tensor 2 x data 4", 4, 1, 2, False),
    "tensor2-fsdp4": ("tensor 2 x fsdp 4", 1, 4, 2, False),
    "single": ("1 device (reference)", 1, 1, 1, False),  # not in the default set
}
DEFAULT = "data8,fsdp8,data4-fsdp2,zero1,tensor2-data4,tensor2-fsdp4"
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def total_bytes(tree) -> int:
    """Bytes of `tree`'s arrays as one device would hold them unsplit (their global size)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def machine() -> str:
    return f"{os.cpu_count()} cores ({versions.cpu_model()}), load average {loadavg()}"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def build(name: str, overrides: list[str]) -> dict:
    label, data, fsdp, tensor, zero1 = STRATEGIES[name]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        run = validate(compose("config", overrides=[
            *overrides, f"parallel.data={data}", f"parallel.fsdp={fsdp}", f"parallel.tensor={tensor}",
            f"parallel.shard_optimizer_state={str(zero1).lower()}"]))
    tokenizer = T.init_tokenizer(run, None)  # tokenizer=byte: no documents, no training
    run = resolve_vocab(run, tokenizer.vocab_size)
    devices = jax.devices()[:data * fsdp * tensor]
    mesh = meshlib.make_mesh(data, fsdp, run.dataset.batch_size, devices=devices, tensor=tensor)
    t0 = time.perf_counter()
    _, _, state, step = T.init_training(run, mesh)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, shape, dtype=np.int32)
    batch = meshlib.put_batch(tokens, meshlib.batch_sharding(mesh, 1))
    t0 = time.perf_counter()
    state, metrics = step(state, batch, False)  # the plain variant: what most steps run
    jax.block_until_ready((state, metrics))
    first_s = time.perf_counter() - t0
    state, metrics = step(state, batch, False)  # warm-up
    jax.block_until_ready((state, metrics))
    return {"label": label, "run": run, "step": step, "state": state, "batch": batch, "init": init_s,
            "first": first_s, "times": [], "tokens": int(np.prod(shape[:2])) * run.context_length,
            "params": device_bytes(state.model), "params_total": total_bytes(state.model),
            "opt": device_bytes(state.opt_state), "opt_total": total_bytes(state.opt_state),
            "aux": device_bytes(state.metric_states)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=DEFAULT,
                        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default: {DEFAULT})")
    parser.add_argument("--model", default="gpt_bench", help="conf/model/ option (default gpt_bench)")
    parser.add_argument("--small", action="store_true", help="shorthand for --model gpt_tiny (a quick run)")
    parser.add_argument("--batch-size", type=int, default=16, help="global sequences per step; divisible by 8")
    parser.add_argument("--optimizer", default="adamw", help="conf/optimizer/ option (default adamw)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy per round")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of --steps steps")
    args, extra = parser.parse_known_args()
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    if len(jax.devices()) < 8:
        sys.exit(f"need 8 devices, jax sees {len(jax.devices())} (XLA_FLAGS={os.environ['XLA_FLAGS']!r})")
    model = "gpt_tiny" if args.small else args.model
    overrides = [f"model={model}", f"optimizer={args.optimizer}", "tokenizer=byte",
                 f"dataset.batch_size={args.batch_size}", *extra]
    started, load_start = time.perf_counter(), loadavg()

    built = {}
    for name in names:
        built[name] = build(name, overrides)
        b = built[name]
        print(f"built {name}: init {b['init']:.1f} s, first step (compile) {b['first']:.1f} s", flush=True)

    for _ in range(args.rounds):  # interleaved: a slow spell of the machine hits every strategy
        for name in names:
            b = built[name]
            for _ in range(args.steps):
                t0 = time.perf_counter()
                b["state"], metrics = b["step"](b["state"], b["batch"], False)
                jax.block_until_ready((b["state"], metrics))
                b["times"].append(time.perf_counter() - t0)

    first = built[names[0]]
    run, mib = first["run"], 2**20
    print(f"\n{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} | {machine()} (at start: {load_start})")
    print(f"command: {shlex.join(['python', *sys.argv])}")
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} (forced host devices) | "
          f"model={model}: {count_params(first['state'].model) / 1e6:.1f}M params = "
          f"{first['params_total'] / mib:.1f} MiB, optimizer {args.optimizer} state {first['opt_total'] / mib:.1f} "
          f"MiB (1-device totals) | batch {args.batch_size} x {run.context_length} = {first['tokens']:,} tokens/step "
          f"| {run.train.compute_dtype} | aux buffers {'on' if first['state'].metric_states else 'off'}")
    print(f"median of {args.rounds}x{args.steps} steps after 1 warm-up; 8 devices share the host's cores: "
          "the table compares layouts, not scaling\n")
    print("| strategy | mesh (data x fsdp x tensor) | first call (compile + 1 step) | step (median) | tokens/s | "
          "params / device | optimizer state / device | optimizer state share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        b = built[name]
        _, data, fsdp, tensor, _ = STRATEGIES[name]
        med = statistics.median(b["times"])
        print(f"| {b['label']} | {data} x {fsdp} x {tensor} | {b['first']:.1f} s | {med * 1e3:,.0f} ms | "
              f"{b['tokens'] / med:,.0f} | {b['params'] / mib:.1f} MiB | {b['opt'] / mib:.1f} MiB | "
              f"{b['opt'] / b['opt_total']:.3f} (1/{b['opt_total'] / max(b['opt'], 1):.1f}) |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load average at end {loadavg()}")


if __name__ == "__main__":
    main()
