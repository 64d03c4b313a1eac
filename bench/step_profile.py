"""Where one train step's time goes: XLA's own profile of the compiled step, by kind of op, by phase
and by the line of our code that made it, and every matmul with its shapes and speed.

    python bench/step_profile.py                         # gpt_bench, batch 16, the plain step
    python bench/step_profile.py --logging-step          # the logging variant (diagnostics included)
    python bench/step_profile.py model=gpt_tiny --top 40

Arguments other than the flags are Hydra overrides, as in bench/step_speed.py (the same step).
How: `jax.profiler.trace` around `--steps` steps, its XSpace read back with jaxlib's profile-data
reader (a private module: a jax upgrade may move it), each XLA:CPU op event matched to the
optimized HLO of the step (`.lower().compile().as_text()`), whose metadata names the jax op and the
Python frames that traced it. Op times are summed over XLA's threads, so they add up to more than
the step's wall time when ops run side by side, and on a loaded machine they include the waits of
preempted threads: compare shares, not milliseconds, between runs.

Kinds: `matmul` (dots, YNNPACK's or Eigen's, with their fused neighbours), `transpose/copy`
(layout changes), `slice/pad/concat` (cutting and joining arrays, the stacked-block weight slices),
`reduce`, `elementwise`. Phases: `forward` (ops under jax's jvp), `backward` (its transpose), `rest`
(optimizer, metrics). Like step_speed.py it re-executes itself with glibc's huge pages first
(utils/host_memory.py) unless `EQTRAIN_HUGE_PAGES=0`, and counts page faults per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import host_memory

if __name__ == "__main__":  # not in main(): tests call it in pytest's process
    host_memory.use_huge_pages(__file__)  # first, before jax loads: the re-execution then costs ~nothing

import jax
import numpy as np
from hydra import compose, initialize_config_dir

import train_jax as T
from utils.config import validate
from utils.parallel import mesh as meshlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
KINDS = ("matmul", "transpose/copy", "slice/pad/concat", "reduce", "elementwise")


def parse_hlo(text: str):
    """(computations {name: body lines}, instructions {name: line}, stack frames) of optimized HLO text."""
    comps, instrs, cur = {}, {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            cur = comps.setdefault(head.group(1), [])
            continue
        inst = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if cur is not None and inst:
            cur.append(line)
            instrs.setdefault(inst.group(1), line)
    return comps, instrs, parse_frames(text)


def parse_frames(text: str):
    """The HLO module's FileNames / FunctionNames / FileLocations / StackFrames tables."""
    files, funcs, locs, frames = {}, {}, {}, {}
    names = {"FileNames": files, "FunctionNames": funcs}
    table = None
    for line in text.splitlines():
        s = line.strip()
        if s in names or s in ("FileLocations", "StackFrames"):
            table = names.get(s)
        elif table is not None and (m := re.match(r'^(\d+) "(.*)"$', s)):
            table[int(m.group(1))] = m.group(2)
        elif m := re.match(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", s):
            locs[int(m.group(1))] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
        elif m := re.match(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", s):
            frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return files, funcs, locs, frames


def source_line(line: str, tables) -> str:
    """`path:line function` of the innermost frame in this repository that traced an HLO instruction."""
    files, funcs, locs, frames = tables
    m = re.search(r"stack_frame_id=(\d+)", line)
    frame, seen = (int(m.group(1)) if m else -1), set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        loc, parent = frames[frame]
        f, fn, n = locs.get(loc, (0, 0, 0))
        path = files.get(f, "")
        if path.startswith(REPO) and f"{os.sep}.venv{os.sep}" not in path:
            return f"{path[len(REPO):]}:{n} {funcs.get(fn, '?')}"
        frame = parent
    return "(jax/optax internals)"


def shape_of(text: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def result_type(line: str) -> str:
    return re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\S+)", line).group(1)


def dot_info(body: list[str], outer: dict) -> tuple[float, str] | None:
    """(FLOPs, 'lhs x rhs, contracting dims') of the first dot in a fusion body (or a bare dot line);
    `outer`: the result types of every instruction (a bare dot's operands are defined outside it)."""
    names = (re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", x) for x in body)
    shapes = {**outer, **{m.group(1): result_type(m.string) for m in names if m}}
    for x in body:
        d = re.search(r"= (\S+) dot\(%([\w.\-]+), %([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}", x)
        if d:
            lhs, rhs = shapes.get(d.group(2), "?"), shapes.get(d.group(3), "?")
            k = math.prod(shape_of(lhs)[int(c)] for c in d.group(4).split(",") if c) if shape_of(lhs) else 0
            dims = re.search(r"(lhs_batch_dims=\{[\d,]*\}, )?lhs_contracting.*?rhs_contracting_dims=\{[\d,]*\}", x)
            operands = f"{lhs.split('{')[0]} x {rhs.split('{')[0]}"
            return 2.0 * math.prod(shape_of(d.group(1))) * k, f"{operands} ({dims.group(0)})"
    return None


def classify(line: str, body: list[str]) -> str:
    text = "\n".join(body) or line
    if " dot(" in text:
        return "matmul"
    if " transpose(" in text or re.search(r"= \S+ copy\(", text):
        return "transpose/copy"
    if re.search(r" (slice|pad|concatenate|dynamic-slice|dynamic-update-slice)\(", text):
        return "slice/pad/concat"
    if re.search(r" reduce(-window)?\(", text):
        return "reduce"
    return "elementwise"


def phase(line: str) -> str:
    name = re.search(r'op_name="([^"]*)"', line)
    name = name.group(1) if name else ""
    return "backward" if "transpose(jvp" in name else "forward" if "jvp(" in name else "rest"


def op_times(trace_dir: str, asynchronous: set[str]) -> collections.Counter:
    """Nanoseconds per XLA op name, summed over XLA's threads (and over the traced steps). The ops in
    `asynchronous` (XLA:CPU hands a plain `dot` to Eigen's thread pool) have an event that covers only
    their dispatch, and an instant `end: NAME` marker when they complete: they are timed to the marker
    (which includes any wait for a busy pool: an upper bound)."""
    from jax._src.lib import _profile_data  # jaxlib's XSpace reader (private: may move in a jax upgrade)

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    starts, ends = collections.defaultdict(list), collections.defaultdict(list)
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if "XLA" not in line.name:
                continue
            for event in line.events:
                if event.name.startswith("end: "):
                    ends[event.name[5:]].append(event.start_ns)
                elif not event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "Threadpool")):
                    starts[event.name].append((event.start_ns, event.end_ns))
    total = collections.Counter()
    for name, spans in starts.items():
        spans.sort()
        marks = sorted(ends.get(name, [])) if name in asynchronous else []
        for i, (start, end) in enumerate(spans):
            limit = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
            done = next((m for m in marks if start <= m < limit), end)
            total[name] += max(end, done) - start
    return total


def eigen_dots(hlo: str) -> set[str]:
    """Names of the step's plain `dot` instructions (not inside a fusion): XLA:CPU runs them with Eigen."""
    return {m.group(1) for m in re.finditer(r"\n\s*(?:ROOT )?%([\w.\-]+) = \S+ dot\(", hlo)}


def report(times: collections.Counter, hlo: str, steps: int, top: int) -> None:
    comps, instrs, tables = parse_hlo(hlo)
    kinds, phases, sources, dots = (collections.Counter() for _ in range(4))
    types = {name: result_type(line) for name, line in instrs.items()}
    flops = collections.Counter()
    for name, ns in times.items():
        line = instrs.get(name)
        if line is None:
            continue
        calls = re.search(r"calls=%([\w.\-]+)", line)
        body = comps.get(calls.group(1), []) if calls else [line]
        ms, kind = ns / steps / 1e6, classify(line, body)
        kinds[kind] += ms
        phases[(phase(line), kind)] += ms
        sources[(phase(line), source_line(line, tables), kind)] += ms
        if kind == "matmul" and (info := dot_info(body, types)):
            key = (phase(line), source_line(line, tables), info[1], "ynn" if "__ynn_fusion" in line else "eigen")
            dots[key] += ms
            flops[key] += info[0]  # each op runs once per step
    total = sum(kinds.values())
    print(f"\nop time {total:,.0f} ms per step, summed over XLA's threads")
    for kind in KINDS:
        by_phase = " | ".join(f"{p} {phases[(p, kind)]:6.0f}" for p in ("forward", "backward", "rest"))
        print(f"  {kind:17s} {kinds[kind]:7.0f} ms {kinds[kind] / total:6.1%}   ({by_phase})")
    print(f"\ntop {top} (phase, source line, kind): ms per step, share")
    for (ph, src, kind), ms in sources.most_common(top):
        print(f"  {ms:7.1f} {ms / total:6.1%}  {ph:8s} {kind:17s} {src}")
    print("\nmatmuls (per step: all calls of one shape from one line; GFLOP/s per thread-second)")
    for key, ms in dots.most_common(top):
        ph, src, shapes, lib = key
        speed = flops[key] / ms / 1e6
        print(f"  {ms:7.1f} ms {speed:5.0f} GFLOP/s {lib:5s} {ph:8s} {src.split()[0]:28s} {shapes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps traced")
    parser.add_argument("--top", type=int, default=25, help="rows of the source-line and matmul tables")
    parser.add_argument("--logging-step", action="store_true", help="profile the logging variant of the step")
    args, overrides = parser.parse_known_args()
    conf_dir = os.path.join(REPO, "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        run = validate(compose("config", overrides=["model=gpt_bench", "dataset.batch_size=16", *overrides]))
    trainer = T.build_trainer(run)
    run, state, step = trainer.run, trainer.state, trainer.train_step
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    tokens = np.random.default_rng(0).integers(0, trainer.tokenizer.vocab_size, shape, dtype=np.int32)
    batch = meshlib.put_batch(tokens, meshlib.batch_sharding(trainer.mesh, 1))
    variant = step.logging if args.logging_step else step.plain
    hlo = variant.lower(state, batch).compile().as_text()
    for _ in range(3):  # compile, then warm
        state, metrics = variant(state, batch)
        jax.block_until_ready(metrics)
    faults, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                state, metrics = variant(state, batch)
                jax.block_until_ready(metrics)
        n = args.steps
        wall_ms, cpu_ms = (time.perf_counter() - wall) / n * 1e3, (time.process_time() - cpu) / n * 1e3
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n
        print(f"{run.model.name} {'logging' if args.logging_step else 'plain'} step, traced: wall {wall_ms:,.0f} ms, "
              f"process CPU {cpu_ms:,.0f} ms, page faults {faults:,.0f} per step "
              f"(host allocator: {os.environ.get('GLIBC_TUNABLES') or 'default'}; load {os.getloadavg()[0]:.1f})")
        report(op_times(trace_dir, eigen_dots(hlo)), hlo, n, args.top)


if __name__ == "__main__":
    main()
