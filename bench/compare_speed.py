"""How a comparison spends its wall time: runs per hour, and the shares of compilation, start-up
and training, for one or more checkouts of eqtrain, alternated in one sitting.

    python bench/compare_speed.py --side before=/tmp/eqtrain-old --side after=. --pairs 2 \\
        optimizers=[adamw,muon] budgets=[15,30,60] lr.points=2 seeds=1 warmup=5 dataset.batch_size=16 \\
        train.max_val_steps=4 logging.log_callback_data=false
    python bench/compare_speed.py --side pack1=. --side pack4=. --side-arg pack4=pack=4 --pairs 2 \\
        model=gpt_tiny optimizers=[adamw,muon] budgets=[15,30,60] lr.points=4 ...   # packed against separate runs

Each pair runs `scripts/compare.py <arguments> dir=<fresh>` of every side (a checkout's path;
default: this one) as a subprocess, in A B then B A order (the machine's speed drifts: bench/pairs.py).
Every comparison starts from an empty compilation cache (the `xla` folder of a cache_dir the sides
share, whose tokenized corpus is warmed once first), so each side pays what a user's first
comparison pays. `--warm` keeps the compilation cache instead: each side first runs the whole
comparison once (its timing dropped), so that what the timed ones pay beyond their training steps
is the per-run costs (composing configs, building and restoring state, saving) rather than the
first compilations. Per comparison, from its runs' metrics.jsonl: wall seconds, runs, runs per hour,
and the shares of the wall time spent compiling (Σ time/compile_sec), starting up (Σ
time/startup_sec), evaluating (Σ time/eval_sec) and in the rest of the trainers' loops (Σ
time/elapsed_sec less compile and evaluation: the training steps, data and logging); what is
left is outside the trainers (composing configs, checkpoint restores, the report). A pack's members
(compare.py's `packed:` lines, `pack=N`) share one loop: its compilation, start-up and loop count
once (the largest member's), its members' evaluations (each its own) add. Needs: minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_values(metrics_path: str) -> dict[str, float]:
    """The last value of every time/ metric of a run's metrics.jsonl (its invocation's totals)."""
    out: dict[str, float] = {}
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            out.update({k: v for k, v in record.items() if k.startswith("time/") and isinstance(v, (int, float))})
    return out


def packs(stdout: str) -> list[list[str]]:
    """The packs compare.py announced (`  packed: id, id, ...`)."""
    return [line.split("packed:", 1)[1].strip().split(", ") for line in stdout.splitlines()
            if line.startswith("  packed: ")]


def account(compare_dir: str, wall: float, packed: list[list[str]] = ()) -> dict[str, float]:
    """The shares of `wall` per phase, summed over the comparison's runs (a pack of `packed`: its
    shared compilation, start-up and loop once, its members' evaluations each)."""
    runs = os.path.join(compare_dir, "runs")
    totals = {"compile": 0.0, "startup": 0.0, "eval": 0.0, "loop": 0.0}
    group = {run: tuple(p) for p in packed for run in p}
    values = {}
    for run in sorted(os.listdir(runs)):
        path = os.path.join(runs, run, "metrics.jsonl")
        if os.path.exists(path):
            values[run] = last_values(path)
    count = len(values)
    for members in {group.get(run, (run,)) for run in values}:
        t = [values[m] for m in members if m in values]
        compile_s = max(v.get("time/compile_sec", 0.0) for v in t)
        eval_s = sum(v.get("time/eval_sec", 0.0) for v in t)
        totals["compile"] += compile_s
        totals["startup"] += max(v.get("time/startup_sec", 0.0) for v in t)
        totals["eval"] += eval_s
        totals["loop"] += max(max(v.get("time/elapsed_sec", 0.0) for v in t) - compile_s - eval_s, 0.0)
    out = {"wall_s": wall, "runs": count, "runs_per_hour": count / wall * 3600}
    out.update({f"{k}_share": v / wall for k, v in totals.items()})
    out["outside_share"] = 1.0 - sum(out[f"{k}_share"] for k in totals)
    return out


def run_side(checkout: str, arguments: list[str], cache_dir: str, work: str, warm: bool = False) -> dict[str, float]:
    if not warm:
        shutil.rmtree(os.path.join(cache_dir, "xla"), ignore_errors=True)  # every comparison compiles afresh
    compare_dir = os.path.join(work, f"comparison{len(os.listdir(work))}")  # a new name: compare.py makes it
    env = {**os.environ, "EQTRAIN_CACHE": cache_dir}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(checkout, "scripts", "compare.py"), *arguments,
                           f"dir={compare_dir}"], cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: compare.py failed:\n{proc.stderr[-3000:]}")
    return account(compare_dir, wall, packs(proc.stdout))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", default=[], metavar="NAME=CHECKOUT",
                        help="a checkout to time (repeatable); default: this one, as 'this'")
    parser.add_argument("--side-arg", action="append", default=[], metavar="NAME=ARG",
                        help="one more compare.py argument for side NAME only (repeatable), e.g. pack4=pack=4")
    parser.add_argument("--pairs", type=int, default=1, help="alternated rounds (default 1)")
    parser.add_argument("--warm", action="store_true",
                        help="keep the compilation cache, filled by one untimed comparison per side")
    parser.add_argument("arguments", nargs="*", help="compare.py's knobs and run overrides")
    args = parser.parse_args(argv)
    sides = dict(s.split("=", 1) for s in args.side) or {"this": REPO}
    sides = {name: os.path.abspath(path) for name, path in sides.items()}
    extra: dict[str, list[str]] = {name: [] for name in sides}
    for a in args.side_arg:
        name, arg = a.split("=", 1)
        if name not in sides:
            raise SystemExit(f"--side-arg {a}: no side {name!r} (sides: {', '.join(sides)})")
        extra[name].append(arg)
    work = tempfile.mkdtemp(prefix="compare_speed_")
    cache_dir = os.path.join(work, "cache")
    # Warm the tokenized corpus (not a compilation cost): one run of the first side, its timing dropped.
    run_side(next(iter(sides.values())), [*args.arguments, "optimizers=[adamw]", "budgets=[4]", "lr.points=1",
                                          "seeds=1", "warmup=1"], cache_dir, work)
    if args.warm:
        for name, checkout in sides.items():
            run_side(checkout, [*args.arguments, *extra[name]], cache_dir, work, warm=True)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for i in range(args.pairs):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            results[name].append(run_side(sides[name], [*args.arguments, *extra[name]], cache_dir, work, args.warm))
            r = results[name][-1]
            print(f"pair {i + 1} {name}: {r['wall_s']:.1f} s, {r['runs']} runs, {r['runs_per_hour']:.0f} runs/h",
                  flush=True)
    keys = ["wall_s", "runs", "runs_per_hour", "compile_share", "startup_share", "eval_share", "loop_share",
            "outside_share"]
    print(f"{'side':<10}" + "".join(f"{k:>15}" for k in keys))
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        print(f"{name:<10}" + "".join(f"{med[k]:>15.3f}" if k.endswith("share") else f"{med[k]:>15.1f}"
                                      for k in keys))
    if len(sides) == 2:
        a, b = list(sides)
        ratio = statistics.median(rb["runs_per_hour"] / ra["runs_per_hour"]
                                  for ra, rb in zip(results[a], results[b]))
        print(f"runs per hour, {b} / {a}: {ratio:.2f}x (median over pairs)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
