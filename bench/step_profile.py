"""Where one train step's time goes: XLA's own profile of the compiled step, by kind of op, by phase
and by the line of our code that made it, and every matmul with its shapes and speed.

    python bench/step_profile.py                         # gpt_bench, batch 16, the plain step
    python bench/step_profile.py --logging-step          # the logging variant (diagnostics included)
    python bench/step_profile.py model=gpt_tiny --top 40
    python bench/step_profile.py model=gpt2_124m train.compute_dtype=bfloat16 --save prof   # on a GPU; keeps the trace
    python bench/step_profile.py --from prof             # the report again from a kept trace, on any machine

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
(optimizer, metrics). On a GPU the op times are the kernels' own (each kernel event carries the HLO
op that launched it), the `matmul` kind counts cuBLAS calls and Triton GEMM fusions, `attention` the
cuDNN fused-attention calls, and the report adds the share of the step's wall time the GPU was busy
(idle time is launch overhead or host work) and, for the other ops, the bytes they read and write
against their time (memory-bound kernels should run near the device's bandwidth). `--save DIR`
keeps the trace and the optimized HLO, so `--from DIR` can report again without the device.
Like step_speed.py it re-executes itself with glibc's huge pages first
(utils/host_memory.py) unless `EQTRAIN_HUGE_PAGES=0`, and counts page faults per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import re
import resource
import shutil
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
KINDS = ("matmul", "attention", "transpose/copy", "slice/pad/concat", "reduce", "elementwise")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


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
    """The instruction's result type; of a tuple (a cuBLAS call's (output, workspace)), its first array."""
    text = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\(?\S+)", line).group(1)
    return text.lstrip("(").rstrip(",")


def type_bytes(text: str) -> int:
    """Bytes of every array in a type (a tuple's arrays summed)."""
    return sum(DTYPE_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", text))


def op_bytes(line: str, types: dict) -> int:
    """Bytes an op reads and writes at least: its operands' and its result's sizes, each once."""
    result = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (.*?) [\w\-]+\(", line)
    operands = re.search(r" [\w\-]+\(([^)]*)\)", line)
    names = re.findall(r"%([\w.\-]+)", operands.group(1)) if operands else []
    return (type_bytes(result.group(1)) if result else 0) + sum(type_bytes(types.get(n, "")) for n in names)


def dot_info(body: list[str], outer: dict) -> tuple[float, str] | None:
    """(FLOPs, 'lhs x rhs, contracting dims') of the first dot in a fusion body (or a bare dot line);
    `outer`: the result types of every instruction (a bare dot's operands are defined outside it)."""
    names = (re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", x) for x in body)
    shapes = {**outer, **{m.group(1): result_type(m.string) for m in names if m}}
    for x in body:
        gemm = re.search(r'custom-call\(%([\w.\-]+), %([\w.\-]+).*custom_call_target="__cublas', x)
        if gemm:  # a cuBLAS call: its contraction is in the backend config
            lhs, rhs = shapes.get(gemm.group(1), "?"), shapes.get(gemm.group(2), "?")
            dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', x)
            contract = [int(c.strip('" ')) for c in dims.group(1).split(",") if c.strip('" ')] if dims else []
            k = math.prod(shape_of(lhs)[c] for c in contract) if shape_of(lhs) else 0
            out = shape_of(result_type(x))
            return 2.0 * math.prod(out) * k, f"{lhs.split('{')[0]} x {rhs.split('{')[0]} (cuBLAS)"
        d = re.search(r"= (\S+) dot\(%([\w.\-]+), %([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}", x)
        if d:
            lhs, rhs = shapes.get(d.group(2), "?"), shapes.get(d.group(3), "?")
            k = math.prod(shape_of(lhs)[int(c)] for c in d.group(4).split(",") if c) if shape_of(lhs) else 0
            dims = re.search(r"(lhs_batch_dims=\{[\d,]*\}, )?lhs_contracting.*?rhs_contracting_dims=\{[\d,]*\}", x)
            operands = f"{lhs.split('{')[0]} x {rhs.split('{')[0]}"
            return 2.0 * math.prod(shape_of(d.group(1))) * k, f"{operands} ({dims.group(0)})"
    return None


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel that no HLO op names (a library's, inside a command buffer)."""
    if re.search(r"gemm|xmma|nvjet|cutlass|cublas", name, re.I):
        return "matmul"
    if re.search(r"sdpa|fmha|flash", name, re.I):
        return "attention"
    if re.search(r"memcpy|memset|copy", name, re.I):
        return "transpose/copy"
    return "elementwise"


def classify(line: str, body: list[str]) -> str:
    text = "\n".join(body) or line
    if " dot(" in text or 'custom_call_target="__cublas' in text:
        return "matmul"
    if 'custom_call_target="__cudnn$fmha' in text:
        return "attention"
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


def op_times(trace_dir: str, asynchronous: set[str]) -> tuple[collections.Counter, float | None]:
    """(nanoseconds per XLA op name, summed over the traced steps; the GPU's busy nanoseconds, None
    on a CPU). On a CPU the ops are XLA's threads' events, summed over the threads; the ops in
    `asynchronous` (XLA:CPU hands a plain `dot` to Eigen's thread pool) have an event that covers only
    their dispatch, and an instant `end: NAME` marker when they complete: they are timed to the marker
    (which includes any wait for a busy pool: an upper bound). On a GPU they are the kernels' events
    on the device's streams, each named by the HLO op that launched it (its `hlo_op` stat)."""
    from jax._src.lib import _profile_data  # jaxlib's XSpace reader (private: may move in a jax upgrade)

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    starts, ends = collections.defaultdict(list), collections.defaultdict(list)
    kernels, spans_gpu = collections.Counter(), []
    for plane in _profile_data.ProfileData.from_file(path).planes:
        on_gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if not on_gpu and "XLA" not in line.name:
                continue
            for event in line.events:
                if on_gpu:
                    op = dict(event.stats).get("hlo_op")
                    if op is not None:  # inside a command buffer (a CUDA graph) the kernel's own name
                        name = event.name if str(op).startswith("command_buffer") else str(op)
                        kernels[name] += event.end_ns - event.start_ns  # is the fusion's, or a library's
                        spans_gpu.append((event.start_ns, event.end_ns))
                elif event.name.startswith("end: "):
                    ends[event.name[5:]].append(event.start_ns)
                elif not event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "Threadpool")):
                    starts[event.name].append((event.start_ns, event.end_ns))
    if kernels:
        return kernels, float(union_length(spans_gpu))
    total = collections.Counter()
    for name, spans in starts.items():
        spans.sort()
        marks = sorted(ends.get(name, [])) if name in asynchronous else []
        for i, (start, end) in enumerate(spans):
            limit = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
            done = next((m for m in marks if start <= m < limit), end)
            total[name] += max(end, done) - start
    return total, None


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (kernels on several streams overlap)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            total += (cur_end - cur_start) if cur_end is not None else 0.0
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


def eigen_dots(hlo: str) -> set[str]:
    """Names of the step's plain `dot` instructions (not inside a fusion): XLA:CPU runs them with Eigen."""
    return {m.group(1) for m in re.finditer(r"\n\s*(?:ROOT )?%([\w.\-]+) = \S+ dot\(", hlo)}


def report(times: collections.Counter, hlo: str, steps: int, top: int, busy_ns: float | None = None,
           wall_ms: float | None = None) -> None:
    comps, instrs, tables = parse_hlo(hlo)
    kinds, phases, sources, dots = (collections.Counter() for _ in range(4))
    types = {name: result_type(line) for name, line in instrs.items()}
    flops, moved, unmatched = collections.Counter(), collections.Counter(), collections.Counter()
    trips = trip_counts(comps, instrs)
    kernel_names = {re.sub(r"[.\-]", "_", n): n for n in instrs}  # a GPU kernel is named `fusion_12` for `fusion.12`
    for name, ns in times.items():
        name = name if name in instrs else kernel_names.get(name, name)
        line = instrs.get(name)
        if line is None:  # a library's kernel launched from a command buffer: its kind from its name
            kind = kernel_kind(name)
            kinds[kind] += ns / steps / 1e6
            unmatched[(kind, name[:80])] += ns / steps / 1e6
            continue
        calls = re.search(r"calls=%([\w.\-]+)", line)
        body = comps.get(calls.group(1), []) if calls else [line]
        ms, kind = ns / steps / 1e6, classify(line, body)
        kinds[kind] += ms
        phases[(phase(line), kind)] += ms
        sources[(phase(line), source_line(line, tables), kind)] += ms
        if kind == "matmul" and (info := dot_info(body, types)):
            lib = "ynn" if "__ynn_fusion" in line else "cublas" if "__cublas" in line else \
                "triton" if "__triton" in line else "eigen" if busy_ns is None else "xla"
            key = (phase(line), source_line(line, tables), info[1], lib)
            dots[key] += ms
            flops[key] += info[0] * trips.get(name, 1)
        elif kind != "matmul":
            moved[(phase(line), source_line(line, tables), kind, name)] = (
                ms, op_bytes(line, types) * trips.get(name, 1))
    total = sum(kinds.values())
    where = "on the GPU's streams" if busy_ns is not None else "summed over XLA's threads"
    print(f"\nop time {total:,.1f} ms per step, {where}")
    if busy_ns is not None and wall_ms:
        busy = busy_ns / steps / 1e6
        print(f"GPU busy {busy:,.1f} ms of the {wall_ms:,.1f} ms step ({busy / wall_ms:.1%}); "
              f"the rest is launch gaps and host work")
    for kind in KINDS:
        by_phase = " | ".join(f"{p} {phases[(p, kind)]:7.1f}" for p in ("forward", "backward", "rest"))
        print(f"  {kind:17s} {kinds[kind]:8.1f} ms {kinds[kind] / max(total, 1e-9):6.1%}   ({by_phase})")
    if unmatched:
        print(f"\nkernels named by their library, not by an HLO op (cuBLAS, cuDNN, copies: "
              f"{sum(unmatched.values()):.1f} ms per step, in the kinds above):")
        for (kind, name), ms in unmatched.most_common(top):
            print(f"  {ms:7.2f} ms {kind:17s} {name}")
    print(f"\ntop {top} (phase, source line, kind): ms per step, share")
    for (ph, src, kind), ms in sources.most_common(top):
        print(f"  {ms:7.1f} {ms / total:6.1%}  {ph:8s} {kind:17s} {src}")
    unit = "TFLOP/s" if busy_ns is not None else "GFLOP/s per thread-second"
    print(f"\nmatmuls (per step: all calls of one shape from one line; {unit})")
    for key, ms in dots.most_common(top):
        ph, src, shapes, lib = key
        speed = flops[key] / ms / (1e9 if busy_ns is not None else 1e6)
        print(f"  {ms:7.2f} ms {speed:6.0f} {lib:6s} {ph:8s} {src.split()[0]:28s} {shapes}")
    if busy_ns is not None:
        print("\nother ops by time: the bytes each reads and writes at least (operands and result once), GB/s")
        for (ph, src, kind, name), (ms, nbytes) in sorted(moved.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {ms:7.2f} ms {nbytes / ms / 1e6:6.0f} GB/s {kind:17s} {ph:8s} {src.split()[0]:28s} {name}")


def trip_counts(comps: dict, instrs: dict) -> dict[str, int]:
    """{op name: how often it runs per step}: the trip count of the while loop (a scan over blocks)
    whose body holds it; ops elsewhere are left out (once per step)."""
    trips = {}
    for line in instrs.values():
        body, n = re.search(r"body=%([\w.\-]+)", line), re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if body and n:
            trips[body.group(1)] = int(n.group(1))
    return {re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", x).group(1): n
            for comp, n in trips.items() for x in comps.get(comp, [])}


def main_from(source: str, top: int) -> None:
    """The report again from a directory kept by --save."""
    for name in ("profile.json", "step.hlo.txt", "trace.xplane.pb"):
        if not os.path.isfile(os.path.join(source, name)):
            raise SystemExit(f"--from {source}: {name} is missing (--save DIR keeps profile.json, step.hlo.txt "
                             f"and trace.xplane.pb)")
    with open(os.path.join(source, "profile.json")) as f:
        meta = json.load(f)
    with open(os.path.join(source, "step.hlo.txt")) as f:
        hlo = f.read()
    print(meta["header"])
    times, busy = op_times(source, eigen_dots(hlo))
    report(times, hlo, meta["steps"], top, busy, meta["wall_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps traced")
    parser.add_argument("--top", type=int, default=25, help="rows of the source-line and matmul tables")
    parser.add_argument("--logging-step", action="store_true", help="profile the logging variant of the step")
    parser.add_argument("--save", metavar="DIR", help="keep the trace, the optimized HLO and the timings in DIR")
    parser.add_argument("--from", dest="source", metavar="DIR", help="report from a trace kept by --save")
    args, overrides = parser.parse_known_args()
    if args.source:
        main_from(args.source, args.top)
        return
    conf_dir = os.path.join(REPO, "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        run = validate(compose("config", overrides=["model=gpt_bench", "dataset.batch_size=16", *overrides]))
    trainer = T.build_trainer(run)
    run, state, step = trainer.run, trainer.state, trainer.train_step
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    tokens = np.random.default_rng(0).integers(0, trainer.tokenizer.vocab_size, shape, dtype=np.int32)
    batch = meshlib.put_batch(tokens, meshlib.batch_sharding(trainer.mesh, 1))
    variant = step.logging if args.logging_step else step.plain
    hlo = variant.lower(state, batch, step.args).compile().as_text()
    for _ in range(3):  # compile, then warm
        state, metrics = variant(state, batch, step.args)
        jax.block_until_ready(metrics)
    faults, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                state, metrics = variant(state, batch, step.args)
                jax.block_until_ready(metrics)
        n = args.steps
        wall_ms, cpu_ms = (time.perf_counter() - wall) / n * 1e3, (time.process_time() - cpu) / n * 1e3
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n
        header = (f"{run.model.name} {'logging' if args.logging_step else 'plain'} step on "
                  f"{jax.devices()[0].device_kind}, traced: wall {wall_ms:,.1f} ms, process CPU {cpu_ms:,.0f} ms, "
                  f"page faults {faults:,.0f} per step (host allocator: "
                  f"{os.environ.get('GLIBC_TUNABLES') or 'default'}; load {os.getloadavg()[0]:.1f})")
        print(header)
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            trace = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
            shutil.copy(trace, os.path.join(args.save, "trace.xplane.pb"))
            with open(os.path.join(args.save, "step.hlo.txt"), "w") as f:
                f.write(hlo)
            with open(os.path.join(args.save, "profile.json"), "w") as f:
                json.dump({"header": header, "steps": n, "wall_ms": wall_ms, "overrides": overrides}, f)
        times, busy = op_times(trace_dir, eigen_dots(hlo))  # after --save: a report that fails keeps the trace
        report(times, hlo, n, args.top, busy, wall_ms)


if __name__ == "__main__":
    main()
