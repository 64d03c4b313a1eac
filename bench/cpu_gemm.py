"""XLA:CPU's float32 GEMMs by shape and by the library that runs them, under XLA_FLAGS variants, and torch's.

    python bench/cpu_gemm.py                                   # XLA's defaults and PyTorch, 3 rounds
    python bench/cpu_gemm.py --flags=--xla_cpu_use_onednn=true --rounds 4 --no-torch   # defaults vs a flag

The shapes are trainer/flops.py's square peak and gpt_bench's projections (4,096 tokens, dim 384,
qkv 3·384 and MLP 4·384) in the three products of a training step: forward x·W, input gradient
dy·Wᵀ, weight gradient xᵀ·dy. Each variant runs in a fresh process (XLA_FLAGS is read once, when
jax starts), after bench/pairs.py's quiet wait, the variants' order flipping each round; a figure
is the best of 7 calls, and the table shows each figure's median over rounds. `route` says what XLA
compiled the product to: `ynn` (a YNNPACK fusion) or `eigen` (a plain dot, XLA's Eigen runtime).
Children get glibc's huge pages as the benches do (utils/host_memory.py). docs/performance.md, "The
CPU step on an AMX Xeon", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TOKENS, DIM = 4096, 384
SHAPES = {"square 1024": (1024, 1024, 1024), "square 2048": (2048, 2048, 2048),
          "qkv": (TOKENS, DIM, 3 * DIM), "mlp": (TOKENS, DIM, 4 * DIM)}
PRODUCTS = ("x·W", "dy·Wᵀ", "xᵀ·dy")


def _best(f, *args, repeats: int = 7) -> float:
    """The fastest of `repeats` calls of f(*args), after one untimed call."""
    f(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def _operands(m: int, k: int, n: int, product: str, randn):
    """The two operands of `product` for a forward x (m x k) · W (k x n), and the function of them."""
    if product == "x·W":
        return randn(m, k), randn(k, n), lambda a, b: a @ b
    if product == "dy·Wᵀ":
        return randn(m, n), randn(k, n), lambda a, b: a @ b.T
    return randn(m, k), randn(m, n), lambda a, b: a.T @ b


def measure_xla() -> dict:
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    out = {}
    for name, (m, k, n) in SHAPES.items():
        for product in PRODUCTS if name in ("qkv", "mlp") else PRODUCTS[:1]:
            a, b, f = _operands(m, k, n, product, lambda *s: jax.random.normal(next(keys), s, jnp.float32))
            jitted = jax.jit(f)
            text = jitted.lower(a, b).compile().as_text()
            route = "ynn" if "__ynn_fusion" in text else "eigen" if " dot(" in text else "other"
            seconds = _best(lambda g, a, b: g(a, b).block_until_ready(), jitted, a, b)
            out[f"{name} {product}"] = {"gflops": 2 * m * k * n / seconds / 1e9, "route": route}
    return out


def measure_torch() -> dict:
    import torch

    torch.manual_seed(0)
    out = {}
    for name, (m, k, n) in SHAPES.items():
        for product in PRODUCTS if name in ("qkv", "mlp") else PRODUCTS[:1]:
            a, b, f = _operands(m, k, n, product, torch.randn)
            seconds = _best(f, a, b)
            out[f"{name} {product}"] = {"gflops": 2 * m * k * n / seconds / 1e9,
                                        "route": f"torch, {torch.get_num_threads()} threads"}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", action="append", default=[], help="an XLA_FLAGS variant, measured beside "
                        "XLA's defaults (repeatable; write --flags=--xla_...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch's GEMMs out")
    parser.add_argument("--quiet", type=float, default=0.15, help="wait until others use under this CPU share")
    parser.add_argument("--child", choices=("xla", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_xla() if args.child == "xla" else measure_torch()))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pairs import wait_for_quiet

    variants = [("xla", flags) for flags in ["", *args.flags]] + ([] if args.no_torch else [("torch", "")])
    results: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    for r in range(args.rounds):
        order = list(range(len(variants)))
        for i in order if r % 2 == 0 else order[::-1]:
            kind, flags = variants[i]
            wait_for_quiet(args.quiet, 120, log=lambda s: None)
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind],
                                  env={**env, "XLA_FLAGS": flags}, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{kind} [{flags}] failed: {done.stderr.strip().splitlines()[-1]}")
            results[i].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for i, (kind, flags) in enumerate(variants):
        print(f"\n{kind} {'[' + flags + ']' if kind == 'xla' else ''} (GFLOP/s, median of {args.rounds} rounds)")
        for key in results[i][0]:
            figures = [round(run[key]["gflops"]) for run in results[i]]
            print(f"  {key:18s} {statistics.median(figures):5.0f}  {results[i][0][key]['route']:9s} {figures}")


if __name__ == "__main__":
    main()
