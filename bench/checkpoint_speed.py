"""What a checkpoint costs: its size, how long `Checkpointer.save` blocks, how long the write
takes, and how much the train steps that run while an asynchronous write is in flight slow down.

    python bench/checkpoint_speed.py                    # gpt2_124m, batch 1 x context 256 on CPU
    python bench/checkpoint_speed.py model=gpt_tiny dataset.batch_size=8 --steps 4 --windows 1   # smoke
    python bench/checkpoint_speed.py dataset.batch_size=8 dataset.context_length=1024             # GPU

Trailing arguments are Hydra overrides of conf/config.yaml (the state and step are the ones
`train_jax.py` builds); the defaults add model=gpt2_124m, dataset.batch_size=1 and, for
gpt2_124m, dataset.context_length=256 (batch 1 x 1024 tokens takes several seconds a step on a
2-core CPU; 1 x 256 keeps a step near 1-3 s and the bench within ~10 minutes). checkpoint.* is
set here, to a temporary directory that is deleted at exit, after every write has finished.

Measured, in this order:

1. no-save steps: --steps timed steps after the compiling one and --warmup more, each ended by
   a device sync; --gap more before each save window and --after more at the end. The
   baseline is the median of all of them (interleaved, so a slow spell of a shared machine hits
   baseline and windows alike); the first block's median is printed too;
2. a synchronous save (checkpoint.async_save=false): `save` is the whole write;
3. two asynchronous saves with nothing else running (the first also pays orbax's set-up): time
   until `save` returns (arrays off the device) and until `wait()` returns (files written and
   renamed to iter_N); with the CPU time the process spent on it (the writer's cost in
   core-seconds, a figure that contention on the machine changes far less than wall time);
4. --windows save windows: a step is dispatched and `save` called right after it, as
   `run_training` does, so that step's time includes the save's blocking part; the following
   steps are timed one by one until orbax reports the write finished. slowdown = mean step time
   of the windows (save steps included) / baseline - 1; "overlapped" counts the steps after the
   save step that started while the write was still going on. A machine shared with other jobs
   changes speed from one minute to the next, so the summary row uses the paired figure: each
   window's steps against the median of the no-save steps just before and just after it (its
   --gap steps and the next window's, or the --after steps); the figure against the median of
   all no-save steps is printed beside it.

With --remote (checkpoint.remote, utils/checkpoint/remote.py) it measures the mirror instead:
windows of steps, each opened by an asynchronous save, alternately to a local-only checkpointer
and to one that also uploads (ABBA order, so a drift of the machine's speed hits both alike);
each window lasts at least as long as a save and its upload take, and every write and upload
finishes, untimed, before the next window. The slowdown is the median over rounds of
(mean step of the uploading window / mean step of the local one) - 1, printed with tokens/s.
`--remote local` starts SeaweedFS on this machine (tests/s3_server.py, at nice 19 to stand for a
server elsewhere; it still shares the cores); `--remote s3://bucket/prefix` uses the AWS
environment's endpoint and credentials (the bench's objects are deleted at the end).

    python bench/checkpoint_speed.py --remote local model=gpt_bench dataset.batch_size=16

Checkpoint size is what one iter_N holds on disk (model, AdamW mu and nu, step/key, manifest,
config). A "complete" write is orbax's (files closed and renamed), not an fsync: with free
memory the bytes may still be in the page cache. The load average is printed at start and end:
on a shared machine, read the slowdown with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from hydra import compose, initialize_config_dir

import train_jax as T
from models import count_params
from utils.checkpoint import storage as ckptlib
from utils.config import to_dict, validate
from utils.logging.messages import warn
from utils.parallel import mesh as meshlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
MB = 1e6
DEFAULT_MODEL = "gpt2_124m"
DEFAULT_BATCH = "dataset.batch_size=1"
DEFAULT_CONTEXT = "dataset.context_length=256"  # only for DEFAULT_MODEL: other models keep their own


def with_defaults(overrides: list[str]) -> list[str]:
    def given(key: str) -> bool:
        return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)

    model = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0] == "model"), DEFAULT_MODEL)
    out = [] if given("model") else [f"model={DEFAULT_MODEL}"]
    if not given("dataset.batch_size"):
        out.append(DEFAULT_BATCH)
    if model == DEFAULT_MODEL and not given("dataset.context_length"):
        out.append(DEFAULT_CONTEXT)
    return [*out, *overrides]


def dir_bytes(path: str) -> int:
    """Apparent size of every file under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load() -> str:
    return "load avg " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def saving(saver: ckptlib.Checkpointer) -> bool:
    """Whether an asynchronous write is still in flight (orbax's own progress tracker)."""
    return saver.writing()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="no-save steps timed before the saves")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one")
    parser.add_argument("--windows", type=int, default=3, help="asynchronous saves timed against training steps")
    parser.add_argument("--gap", type=int, default=3, help="no-save steps timed before each window")
    parser.add_argument("--after", type=int, default=3, help="no-save steps timed after the last window")
    parser.add_argument("--max-window-steps", type=int, default=100, help="stop stepping a window after this many")
    parser.add_argument("--tmp", default=None, help="parent of the temporary checkpoint directory (default: $TMPDIR)")
    parser.add_argument("--remote", default=None, help="measure checkpoint.remote instead: s3://bucket/prefix, or "
                        "'local' for a SeaweedFS started here")
    parser.add_argument("--rounds", type=int, default=6, help="--remote: rounds of (local, uploading) windows")
    parser.add_argument("--remote-bandwidth", type=float, default=None,
                        help="--remote: checkpoint.remote_bandwidth (MB/s cap on the upload; default: none)")
    parser.add_argument("--remote-window", type=int, default=4, help="--remote: steps per window at least")
    args, overrides = parser.parse_known_args()
    if args.steps < 1 or args.windows < 1 or args.gap < 1 or args.after < 1:
        parser.error("--steps, --windows, --gap and --after must be at least 1")
    overrides = with_defaults(overrides)
    model_name = next(o for o in reversed(overrides) if o.startswith("model=")).split("=", 1)[1]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        config_dict = to_dict(compose("config", overrides=overrides))
    run = validate(config_dict)

    t0 = time.perf_counter()
    trainer = T.build_trainer(run)
    run, data, state, step_fn = trainer.run, trainer.data, trainer.state, trainer.train_step
    sharding = meshlib.batch_sharding(trainer.mesh, 1)
    n_params = count_params(state.model)
    shape = f"{run.dataset.batch_size}x{run.context_length}" + (
        f" (x{run.dataset.accum_steps} accum)" if run.dataset.accum_steps > 1 else "")
    print(f"model {model_name} | params {n_params / 1e6:.2f}M (vocab {run.model.vocab_size}) | batch x context "
          f"{shape} = {data.tokens_per_step:,} tokens/step | {run.optimizer.name} | {run.train.compute_dtype} | "
          f"{len(jax.devices())} x {jax.devices()[0].device_kind} | setup {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"overrides: {' '.join(overrides)} | {load()}", flush=True)

    metrics: dict = {}
    labels = itertools.count(1)  # iteration numbers of the bench's checkpoints: each save a new one
    no_save: list[float] = []
    step_cpu: list[float] = []

    def one_step() -> float:
        """One step on the next real batch, waited for; its wall time."""
        nonlocal state, metrics
        batch = meshlib.put_batch(next(data.train), sharding)
        t, c = time.perf_counter(), cpu_seconds()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        step_cpu.append(cpu_seconds() - c)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    one_step()
    print(f"compile (first step): {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(args.warmup):
        one_step()
    step_cpu.clear()
    first = [one_step() for _ in range(args.steps)]
    no_save += first
    cpu_per_step = statistics.median(step_cpu)
    print(f"no-save steps: {statistics.median(first):.3f} s median over {len(first)} (min {min(first):.3f}, "
          f"max {max(first):.3f}) | {cpu_per_step:.2f} CPU-s per step", flush=True)

    def save_step(saver: ckptlib.Checkpointer) -> float:
        """A step dispatched and `saver.save` called right after it, as run_training does; its wall time."""
        nonlocal state, metrics
        batch = meshlib.put_batch(next(data.train), sharding)
        label = next(labels)
        t = time.perf_counter()
        state, metrics = step_fn(state, batch)
        saver.save(label, state, data.train.state_dict(), {}, "bench")
        jax.block_until_ready(metrics)
        return time.perf_counter() - t

    if args.remote:
        compare_remote(args, run, config_dict, data.tokens_per_step, statistics.median(first), cpu_per_step, one_step,
                       save_step)
        return

    tmp = tempfile.mkdtemp(prefix="eqtrain_ckpt_bench_", dir=args.tmp)
    savers: list[ckptlib.Checkpointer] = []
    windows: list[dict] = []

    def checkpointer(name: str, async_save: bool) -> ckptlib.Checkpointer:
        ck = dataclasses.replace(run.checkpoint, save=True, save_path=os.path.join(tmp, name), async_save=async_save,
                                 max_to_keep=None, keep_best=False, save_steps=1_000_000_000)
        saver = ckptlib.Checkpointer(ck, {**config_dict, "checkpoint": dataclasses.asdict(ck)},
                                     dataclasses.asdict(run.model), warn)
        savers.append(saver)
        return saver

    def save_quiet(saver: ckptlib.Checkpointer, name: str) -> tuple[float, float, float, int]:
        """A save of the synced state with nothing else running: save() s, complete s, CPU-s; label."""
        jax.block_until_ready(state)
        label = next(labels)
        t, c = time.perf_counter(), cpu_seconds()
        saver.save(label, state, data.train.state_dict(), {k: float(v) for k, v in metrics.items()}, "bench")
        block = time.perf_counter() - t
        saver.wait()
        return block, time.perf_counter() - t, cpu_seconds() - c, label

    try:
        # -- synchronous: save() is the whole write
        sync = checkpointer("sync", async_save=False)
        sync_block, sync_total, sync_cpu, label = save_quiet(sync, "sync")
        iter_dir = os.path.join(tmp, "sync", f"{ckptlib.STEP_PREFIX}_{label}")
        sizes = {item: dir_bytes(os.path.join(iter_dir, item)) for item in ("model", "opt_state")}
        total_b = dir_bytes(iter_dir)
        print(f"checkpoint on disk: {total_b / MB:,.1f} MB = model {sizes['model'] / MB:,.1f} + opt_state "
              f"{sizes['opt_state'] / MB:,.1f} + rest {(total_b - sizes['model'] - sizes['opt_state']) / MB:,.2f} "
              f"(raw fp32 model + AdamW mu, nu: {n_params * 4 * 3 / MB:,.1f} MB)", flush=True)
        print(f"sync save : save() {sync_block:6.2f} s | complete {sync_total:6.2f} s | "
              f"{total_b / MB / sync_total:5,.0f} MB/s | {sync_cpu:5.2f} CPU-s", flush=True)
        shutil.rmtree(os.path.join(tmp, "sync"), ignore_errors=True)  # keep disk and page cache small

        # -- asynchronous, nothing else running
        asyn = checkpointer("async", async_save=True)
        quiet = []
        for which in ("first (cold)", "second (warm)"):
            block, total, cpu, label = save_quiet(asyn, "async")
            quiet.append((block, total, cpu))
            print(f"async save: save() {block:6.2f} s | complete {total:6.2f} s | {total_b / MB / total:5,.0f} MB/s "
                  f"| {cpu:5.2f} CPU-s | {which}", flush=True)
            shutil.rmtree(os.path.join(tmp, "async", f"{ckptlib.STEP_PREFIX}_{label}"), ignore_errors=True)

        # -- asynchronous saves overlapped with training
        for w in range(args.windows):
            gap = [one_step() for _ in range(args.gap)]  # after the previous write, before this one
            no_save += gap
            batch = meshlib.put_batch(next(data.train), sharding)
            label = next(labels)
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch)  # dispatched, then saved at once, as run_training does
            asyn.save(label, state, data.train.state_dict(), {}, "bench")
            returned = time.perf_counter() - t0
            jax.block_until_ready(metrics)
            times = [time.perf_counter() - t0]
            while saving(asyn) and len(times) < args.max_window_steps:
                times.append(one_step())
            t_wait = time.perf_counter()
            asyn.wait()  # already done unless the window was capped
            leftover = time.perf_counter() - t_wait
            windows.append({"times": times, "overlapped": len(times) - 1, "write": time.perf_counter() - t0,
                            "before": gap})
            print(f"window {w + 1}: gap steps {', '.join(f'{t:.3f}' for t in gap) or '-'} s | "
                  f"save step {times[0]:.3f} s (step + save() returned at {returned:.3f} s) | "
                  f"{len(times) - 1} step(s) during the write: "
                  f"{', '.join(f'{t:.3f}' for t in times[1:]) or '-'} s | write done at {windows[-1]['write']:.2f} s"
                  + (f" (window capped: waited {leftover:.2f} s more)" if leftover > 0.01 else ""), flush=True)
            shutil.rmtree(os.path.join(tmp, "async", f"{ckptlib.STEP_PREFIX}_{label}"), ignore_errors=True)
        after = [one_step() for _ in range(args.after)]
        no_save += after
    finally:
        for saver in savers:
            saver.close()  # every pending write finishes before its directory goes
        shutil.rmtree(tmp, ignore_errors=True)

    base = statistics.median(no_save)
    pooled = [t for w in windows for t in w["times"]]
    mean_window = statistics.mean(pooled)
    slowdown = mean_window / base - 1
    extra = (sum(pooled) - len(pooled) * base) / len(windows)
    overlapped = statistics.mean(w["overlapped"] for w in windows)
    per_window = ", ".join(f"{statistics.mean(w['times']) / base - 1:+.1%}" for w in windows)
    # paired: each window against the no-save steps around it (its gap, and the next gap or the last steps)
    local = [statistics.median(w["before"] + (windows[i + 1]["before"] if i + 1 < len(windows) else after))
             for i, w in enumerate(windows)]
    paired = sum(sum(w["times"]) for w in windows) / sum(len(w["times"]) * b for w, b in zip(windows, local)) - 1
    paired_each = ", ".join(f"{statistics.mean(w['times']) / b - 1:+.1%}" for w, b in zip(windows, local))
    paired_extra = statistics.mean(sum(w["times"]) - len(w["times"]) * b for w, b in zip(windows, local))
    paired_base = sum(len(w["times"]) * b for w, b in zip(windows, local)) / len(pooled)
    async_block, async_total, async_cpu = quiet[-1]
    print(f"baseline: step {base:.3f} s median of {len(no_save)} no-save steps (first block alone "
          f"{statistics.median(first):.3f} s; min {min(no_save):.3f}, max {max(no_save):.3f})")
    print(f"during async save: mean step {mean_window:.3f} s over {len(pooled)} step(s) in {len(windows)} window(s) "
          f"(save steps included) -> slowdown {slowdown:+.1%} (per window {per_window}) | "
          f"{extra:+.2f} s extra per save | {overlapped:.1f} step(s) overlapped the write on average")
    print(f"paired with the no-save steps around each window (local baselines "
          f"{', '.join(f'{b:.3f}' for b in local)} s): slowdown {paired:+.1%} (per window {paired_each}) | "
          f"{paired_extra:+.2f} s extra per save")
    print(f"the quiet async write costs {async_cpu:.2f} CPU-s = {async_cpu / cpu_per_step:.2f} steps' worth "
          f"of CPU ({cpu_per_step:.2f} CPU-s per step on {os.cpu_count()} CPUs) | {load()}")
    print("\n| model | params | batch x ctx | ckpt MB | sync save s | async save() s | async write s "
          "| step s | step during async write s | slowdown | steps overlapped | extra s per save |")
    print(f"| {model_name} | {n_params / 1e6:.1f}M | {shape} | {total_b / MB:,.0f} | {sync_total:.2f} | "
          f"{async_block:.2f} | {async_total:.2f} | {paired_base:.2f} | {mean_window:.2f} | {paired:+.1%} | "
          f"{overlapped:.1f} | {paired_extra:+.2f} |")


def compare_remote(args, run, config_dict: dict, tokens_per_step: int, step_s: float, cpu_per_step: float,
                   one_step, save_step) -> None:
    """--remote: alternating windows without and with the mirror (see the module's docstring)."""
    server = None
    if args.remote == "local":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import s3_server

        server = s3_server.start(tempfile.mkdtemp(prefix="eqtrain_s3_bench_", dir=args.tmp), nice=19)
        os.environ.update(server.env())
        server.client().create_bucket(Bucket="bench")
        url = "s3://bench/checkpoint-speed"
    else:
        url = args.remote
    tmp = tempfile.mkdtemp(prefix="eqtrain_remote_bench_", dir=args.tmp)
    savers: dict[str, ckptlib.Checkpointer] = {}

    def settle(saver: ckptlib.Checkpointer) -> float:
        """Seconds until its write (and upload) is done, the device idle."""
        t = time.perf_counter()
        while saver.writing():
            time.sleep(0.02)
        return time.perf_counter() - t

    try:
        for mode, target in (("local", None), ("uploading", url)):
            ck = dataclasses.replace(run.checkpoint, save=True, save_path=os.path.join(tmp, mode), async_save=True,
                                     max_to_keep=1, keep_best=False, save_steps=1_000_000_000, remote=target,
                                     remote_bandwidth=args.remote_bandwidth if target else None)
            ck.check("checkpoint")
            savers[mode] = ckptlib.Checkpointer(ck, {**config_dict, "checkpoint": dataclasses.asdict(ck)},
                                                dataclasses.asdict(run.model), warn)
        def quiet_save(saver: ckptlib.Checkpointer) -> tuple[float, float]:
            """(wall s, this process's CPU-s) of a step, a save and its write (and upload), then idle."""
            t, c = time.perf_counter(), cpu_seconds()
            save_step(saver)
            settle(saver)
            return time.perf_counter() - t, cpu_seconds() - c

        first = {mode: quiet_save(saver) for mode, saver in savers.items()}  # orbax's and boto3's set-up
        quiet = {mode: quiet_save(saver) for mode, saver in savers.items()}
        upload_cpu = quiet["uploading"][1] - quiet["local"][1]
        window = max(args.remote_window, math.ceil(quiet["uploading"][0] / step_s) + 1)
        print(f"a step + save + write, then idle: local {quiet['local'][0]:.2f} s, with the upload "
              f"{quiet['uploading'][0]:.2f} s (first: {first['local'][0]:.2f}, {first['uploading'][0]:.2f} s) | the "
              f"upload's CPU in this process: {upload_cpu:.2f} CPU-s = {upload_cpu / cpu_per_step:.2f} steps' worth | "
              f"window {window} steps of ~{step_s:.3f} s | {load()}", flush=True)
        rows, cpu_rows = [], []
        for r in range(args.rounds):
            means = {}
            for mode in ("local", "uploading") if r % 2 == 0 else ("uploading", "local"):
                c = cpu_seconds()
                times = [save_step(savers[mode])] + [one_step() for _ in range(window - 1)]
                means[mode] = (statistics.mean(times), (cpu_seconds() - c) / window, settle(savers[mode]))
            (local, local_cpu, _), (up, up_cpu, late) = means["local"], means["uploading"]
            rows.append(up / local)
            cpu_rows.append(up_cpu / local_cpu)
            print(f"round {r + 1}: local {local:.3f} s/step ({tokens_per_step / local:,.0f} tokens/s, "
                  f"{local_cpu:.2f} CPU-s/step) | uploading {up:.3f} s/step ({tokens_per_step / up:,.0f} tokens/s, "
                  f"{up_cpu:.2f} CPU-s/step; the upload ended {late:.2f} s after the window) | slowdown "
                  f"{up / local - 1:+.1%}, CPU {up_cpu / local_cpu - 1:+.1%}", flush=True)
        print(f"\ncheckpoint.remote slowdown: {statistics.median(rows) - 1:+.1%} median over {len(rows)} rounds "
              f"(each {', '.join(f'{x - 1:+.1%}' for x in rows)}); this process's CPU per step "
              f"{statistics.median(cpu_rows) - 1:+.1%} | windows of {window} steps, each opened by a save | "
              f"checkpoint.remote_bandwidth={args.remote_bandwidth} | {load()}")
    finally:
        for saver in savers.values():
            saver.close()
        if server is not None:
            server.close()
        elif "uploading" in savers:
            from utils.checkpoint import remote

            u = remote.parse_url(url)
            client = remote.connect(u)
            for step, files in remote.listing(client, u).items():
                remote.delete(client, u, step, files)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
