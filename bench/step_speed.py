"""Train-step speed of the real pipeline: compile time, median step time, tokens/s and MFU.

    python bench/step_speed.py                          # gpt_bench, batch 16, synthetic vs real data
    python bench/step_speed.py model=gpt_tiny dataset.batch_size=32 --steps 20
    python bench/step_speed.py model=gpt2_124m train.compute_dtype=bfloat16 dataset.batch_size=16   # GPU
    python bench/step_speed.py --pairs 5                # eqtrain vs PyTorch eager and torch.compile, alternated
    python bench/step_speed.py --pairs 5 --quiet 0.1    # each pair waits until other processes leave the CPUs

Arguments other than --steps/--warmup/--data are Hydra overrides of conf/config.yaml, so the
step measured is exactly the one `train_jax.py` compiles. MFU is printed two ways: 6·N (the
parameter count convention of docs/performance.md's table) and 6·N + attention (what train/mfu logs),
against XLA's measured float32 matmul peak on a CPU and the device's bf16 data-sheet peak on an accelerator.

The step timed is the plain variant, which every step but the logging ones (one in
`logging.log_every`) runs; `--logging-step` times the logging variant instead (it adds the metrics
marked "logging steps only": the optimizer diagnostics, the aux-state norms). Run as a script, it
first re-executes itself with glibc's transparent huge pages for large allocations
(utils/host_memory.py: XLA:CPU's per-step temporary buffer otherwise costs ~360,000 page faults a
step); `EQTRAIN_HUGE_PAGES=0` keeps the default allocator. The header says which.

--pairs N alternates eqtrain's step with bench/torch_reference.py's (the same GPT hand-written in
PyTorch: eager, and torch.compile where it works; in train.compute_dtype, bfloat16 under
torch.autocast) N times in this process (bench/pairs.py: warm
both, then k steps of each per pair, the order flipping each pair) and prints each pair's times,
the throughput ratios eqtrain / torch and their medians. It needs torch (the `parity` extra).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import host_memory

if __name__ == "__main__":  # not in main(): tests call it in pytest's process
    host_memory.use_huge_pages(__file__)  # first, before jax loads: the re-execution then costs ~nothing

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from models import count_params, flops_per_token
from trainer.flops import peak_flops
from utils import versions
from utils.config import validate
from utils.parallel import mesh as meshlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairs as pairlib  # bench/pairs.py (bench/ holds scripts, not a package)

NO_TORCH = 'step_speed.py --pairs needs PyTorch: pip install -e ".[dev,parity]"'


def time_steps(step_fn, state, batches, steps: int, warmup: int):
    """Per-step wall times, each ended by a device sync, after `warmup` untimed steps."""
    for _ in range(warmup):
        state, metrics = step_fn(state, next(batches))
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, next(batches))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--data", choices=("both", "synthetic", "real"), default="both")
    parser.add_argument("--repeats", type=int, default=1, help="measure each data source this many times")
    parser.add_argument("--pairs", type=int, default=0, help="alternate with PyTorch's step N times (0 = off)")
    parser.add_argument("--k", type=int, default=3, help="with --pairs: steps of each implementation per pair")
    parser.add_argument("--logging-step", action="store_true", help="time the logging variant of the step")
    parser.add_argument("--quiet", type=float, default=0.0, metavar="SHARE",
                        help="with --pairs: before each pair wait (up to --quiet-wait s) until other processes use "
                             "under SHARE of the CPUs (e.g. 0.1; 0 = never wait)")
    parser.add_argument("--quiet-wait", type=float, default=300.0, help="with --quiet: the longest wait per pair")
    args, overrides = parser.parse_known_args()
    if args.pairs and importlib.util.find_spec("torch") is None:
        sys.exit(NO_TORCH)
    overrides = ["model=gpt_bench", "dataset.batch_size=16", *overrides]
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        run = validate(compose("config", overrides=overrides))
    if args.pairs:
        check_pairs(run)

    trainer = T.build_trainer(run)
    run, data, state = trainer.run, trainer.data, trainer.state
    step_fn = functools.partial(trainer.train_step, logging=args.logging_step)
    tokenizer, sharding = trainer.tokenizer, meshlib.batch_sharding(trainer.mesh, 1)

    flops_full = flops_per_token(run.model, run.context_length) * data.tokens_per_step
    flops_6n = 6 * count_params(state.model) * data.tokens_per_step
    on_cpu = jax.devices()[0].platform == "cpu"
    # CPU: XLA's measured matmul speed in the compute dtype; accelerators: the bf16 data-sheet peak,
    # the usual MFU denominator (llm.c, PaLM) whatever dtype the step runs in.
    peak = peak_flops(run.train.compute_dtype if on_cpu else "bfloat16", run.cache_dir, fresh=True) or float("nan")
    print(f"machine: {versions.describe()}")  # the CPU model of every figure (docs/performance.md)
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} | peak {peak / 1e9:,.0f} GFLOP/s "
          f"({'XLA matmul, measured' if on_cpu else 'bf16 data sheet; nan = unknown device'}) "
          f"| params {count_params(state.model) / 1e6:.2f}M | tokens/step {data.tokens_per_step:,} "
          f"| {run.train.compute_dtype} | scan={run.model.scan_blocks} remat={run.model.remat} "
          f"| {'logging' if args.logging_step else 'plain'} step | host allocator: {allocator()}")

    def synthetic():
        rng = np.random.default_rng(0)
        shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
        batch = rng.integers(0, tokenizer.vocab_size, shape, dtype=np.int32)
        while True:
            yield meshlib.put_batch(batch, sharding)

    def real():
        while True:
            yield meshlib.put_batch(next(data.train), sharding)

    t0 = time.perf_counter()
    state, metrics = step_fn(state, next(synthetic()))  # the first call traces and compiles
    jax.block_until_ready(metrics)
    print(f"compile (first step): {time.perf_counter() - t0:.2f} s")
    if args.pairs:
        return compare_with_torch(args, run, state, step_fn, synthetic(), peak, flops_full, data.tokens_per_step)

    medians = {}
    sources = [(n, f) for n, f in (("synthetic", synthetic), ("real", real)) if args.data in ("both", n)]
    times: dict[str, list[float]] = {n: [] for n, _ in sources}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits both alike
        for name, source in sources:
            state, more = time_steps(step_fn, state, source(), args.steps, args.warmup)
            times[name] += more
    for name, _ in sources:
        med = statistics.median(times[name])
        medians[name] = med
        print(f"{name:>9}: step {med * 1e3:8.1f} ms median (min {min(times[name]) * 1e3:.1f}) | "
              f"{data.tokens_per_step / med:10,.0f} tokens/s | MFU(6N) {flops_6n / med / peak:6.1%} | "
              f"MFU(6N+attn) {flops_full / med / peak:6.1%}")
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # 4 steps: 1 untimed, 3 timed
    state, _ = time_steps(step_fn, state, synthetic(), 3, warmup=1)
    print(f"page faults: {(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / 4:,.0f} per step")
    if len(medians) == 2:
        print(f"real loader, step vs synthetic: {medians['real'] / medians['synthetic'] - 1:+.1%} "
              "(noisy on a shared machine; the direct figure below is the one to trust)")
    # The loader's own cost, timed directly: next window batch from the shuffled token stream,
    # placed on the mesh. It runs on the host while the device computes the previous step.
    feed = real()
    t0 = time.perf_counter()
    for _ in range(200):
        jax.block_until_ready(next(feed))
    per_batch = (time.perf_counter() - t0) / 200
    ref = medians.get("synthetic") or medians.get("real")
    print(f"real loader: {per_batch * 1e6:.0f} us per batch = {per_batch / ref:.3%} of the median step")


def allocator() -> str:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return "glibc huge pages" if host_memory.TUNABLE in tunables else "default (EQTRAIN_HUGE_PAGES=0 or unsupported)"


def check_pairs(run) -> None:
    """--pairs compares what bench/torch_reference.py can build: stop with one line, before anything compiles."""
    import torch_reference as ref

    m = run.model
    if m.name != "gpt" or not m.tie_embeddings or not m.bias or m.dropout or m.moe.num_experts or m.lora.rank:
        sys.exit("step_speed.py --pairs: bench/torch_reference.py is a plain GPT-2 (tied head, biases, no dropout, "
                 "no MoE/LoRA): pick a model=gpt_* config")
    if run.train.compute_dtype not in ref.AUTOCAST:
        sys.exit(f"step_speed.py --pairs: the PyTorch reference runs train.compute_dtype={' or '.join(ref.AUTOCAST)}, "
                 f"not {run.train.compute_dtype}")


def compare_with_torch(args, run, state, step_fn, batches, peak: float, flops: float, tokens: int) -> None:
    """--pairs: eqtrain's step against PyTorch's on the same shape, alternated (bench/pairs.py)."""
    import torch
    import torch_reference as ref

    m = run.model
    on_cpu = jax.devices()[0].platform == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        sys.exit("step_speed.py --pairs on a GPU needs a CUDA build of torch (this one is CPU-only)")
    if on_cpu:
        torch.set_num_threads(os.cpu_count())
    shape = ref.Shape(vocab=m.vocab_size, context=run.context_length, dim=m.dim, heads=m.num_heads,
                      blocks=m.num_blocks, mlp=m.mlp_ratio, batch=tokens // run.context_length)
    device = "cpu" if on_cpu else "cuda"

    def eqtrain():
        nonlocal state
        state, metrics = step_fn(state, next(batches))
        jax.block_until_ready(metrics)

    steps = {"eqtrain": eqtrain}
    dtype = run.train.compute_dtype  # bfloat16: torch.autocast, the same mixed precision
    steps["torch eager"], _ = ref.build_step(shape, device=device, dtype=dtype)
    compiled, _ = ref.build_step(shape, compile=True, device=device, dtype=dtype)
    t0 = time.perf_counter()
    try:  # inductor needs a working C++ compiler on CPU; say so and go on with eager alone
        compiled()
        steps["torch compile"] = compiled
        print(f"torch.compile: first step {time.perf_counter() - t0:.2f} s")
    except Exception as e:  # noqa: BLE001  (any backend failure means: no compiled reference here)
        print(f"torch.compile does not work here ({type(e).__name__}: {str(e).splitlines()[0][:100]}): eager only")

    print(f"{args.pairs} pairs of {args.k} steps each (order flips each pair), after {args.warmup} warm-up steps each; "
          f"torch {torch.__version__} on {device}, {dtype}")
    shares = []
    gate = (lambda: shares.append(pairlib.wait_for_quiet(args.quiet, args.quiet_wait))) if args.quiet else None
    results = pairlib.run_pairs(steps, args.pairs, k=args.k, warmup=args.warmup, before_pair=gate)
    if shares:
        print(f"other processes' share of the CPUs just before each pair: {' '.join(f'{x:.0%}' for x in shares)}")
    refs = [n for n in steps if n != "eqtrain"]
    for i, r in enumerate(results, 1):
        times = " | ".join(f"{n} {r[n] * 1e3:7.1f} ms" for n in steps)
        ratio = " ".join(f"{n.split()[-1]} {r[n] / r['eqtrain']:.2f}x" for n in refs)
        print(f"pair {i}: {times} | eqtrain/torch tokens/s: {ratio}")
    for n in refs:
        rs = pairlib.ratios(results, "eqtrain", n)
        print(f"median ratio eqtrain / {n} (tokens/s): {pairlib.summary(results, 'eqtrain')[n]:.2f}x "
              f"(pairs {min(rs):.2f}-{max(rs):.2f})")
    for n in steps:
        med = statistics.median(r[n] for r in results)
        print(f"{n:>13}: step {med * 1e3:8.1f} ms median | {tokens / med:10,.0f} tokens/s | "
              f"MFU(6N+attn) {flops / med / peak:6.1%} of {'XLA matmul' if on_cpu else 'bf16'} peak")


if __name__ == "__main__":
    main()
