"""XLA:CPU deadlock (jaxlib 0.10.2): a jitted function with several (QRS, default 4) independent
batched jnp.linalg.qr calls can hang for ever at 0% CPU, on its first call or a later one (a race:
2 of 3 attempts of 20 calls hung here). Pure JAX, no eqtrain. Each attempt runs in a subprocess,
called hung once it uses no CPU for 15 s, and prints `ok` or `HUNG` (docs/performance.md,
"jnp.linalg.qr deadlocks XLA:CPU's step").
Usage: `[QRS=K] [ONE_AT_A_TIME=1] python bench/jax_qr_hang_repro.py [ATTEMPTS] [XLA_FLAGS...]`.

The child pins itself to 2 CPUs (XLA:CPU sizes its intra-op pool from the affinity mask), so the pool
has 2 threads on any machine, as on the 2-core VM where eqtrain's Dion step hung.

Upstream report (not filed: this VM has no network):

    Title: XLA:CPU deadlock: batched LAPACK custom calls (QR) running concurrently block every
    intra-op pool thread in jax::ParallelBatchMap

    jax/jaxlib 0.10.2, CPU backend, Linux x86_64. A jitted function with four independent batched QRs
    (float32, 16 x 256 x 64 each) can stop for ever, at 0% CPU, when the intra-op pool has 2 threads (2
    cores; pinned to 2 CPUs elsewhere, not tried), on its first call or a later one (a race). 2 of 3
    attempts hung within 20 calls here, and with 8 such QRs the first call. gdb: both `tf_XLAEigen`
    threads are in lapack_sgeqrf_ffi -> jax::QrFactorization<F32>::Kernel -> jax::ParallelBatchMap ->
    absl::BlockingCounter::Wait, and the executable's thread in tsl::BlockUntilReady. The thunk executor
    runs independent custom-call thunks at once, one per pool thread; each then splits its batch over
    the same pool and waits for the pieces, which no thread is free to run. Any N >= pool size
    concurrent batched LAPACK calls (geqrf here; the same ParallelBatchMap backs the other batched
    kernels: eigh did it too) should do it on N threads. Expected: the batch map runs the pieces inline
    when called from a pool thread (or the caller helps drain its own pieces). Workaround: one matrix
    per LAPACK call (lax.map over the batch: ONE_AT_A_TIME=1 here), so no call splits its batch.
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false does not help.
"""

import os
import subprocess
import sys
import threading
import time

# QRS independent QRs, each of a batch of S tall M x R blocks (Dion's P = A·Q)
K, S, M, R = int(os.environ.get("QRS", 4)), 16, 256, 64
ONE_AT_A_TIME = os.environ.get("ONE_AT_A_TIME") == "1"  # the workaround: lax.map, one matrix per LAPACK call
QR = "jax.lax.map(lambda m: jnp.linalg.qr(m)[0], p)" if ONE_AT_A_TIME else "jnp.linalg.qr(p)[0]"
CALLS = 20
STALL_S, GIVE_UP_S = 15, 600  # hung: no CPU time for STALL_S (a busy shared machine slows it, never stops it)

CHILD = f"""
import os
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # before jax starts: a 2-thread intra-op pool
import jax, jax.numpy as jnp
qrs = jax.jit(lambda ps: [{QR} for p in ps])  # independent: the thunk executor runs them at once
ps_KxSxMxR = [jax.random.normal(jax.random.PRNGKey(i), ({S}, {M}, {R})) for i in range({K})]
for call in range({CALLS}):
    print(call, flush=True)
    jax.block_until_ready(qrs(ps_KxSxMxR))
print("done", flush=True)
"""


def cpu_seconds(pid: int) -> float:
    """The process's CPU time, all threads (Linux /proc): a deadlocked process's stops growing."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def attempt(xla_flags: str) -> str:
    env = dict(os.environ, XLA_FLAGS=xla_flags) if xla_flags else dict(os.environ)
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True).start()
    used, still_since = 0.0, time.perf_counter()
    while child.poll() is None:
        time.sleep(1)
        now = cpu_seconds(child.pid) if child.poll() is None else used
        if now - used > 0.05:  # 0.05 s: more than a sleeping process's wake-ups, far less than a QR call's work
            used, still_since = now, time.perf_counter()
        elif time.perf_counter() - still_since > STALL_S or time.perf_counter() - start > GIVE_UP_S:
            child.kill()
            child.wait()
            at = lines[-1].strip() if lines else "(before the first)"
            return f"HUNG in call {at} of {CALLS}: no CPU time for {STALL_S} s ({used:.1f} s used)"
    wall = time.perf_counter() - start
    if child.returncode or not lines or lines[-1].strip() != "done":
        return f"failed (exit {child.returncode})"
    return f"ok ({CALLS} calls, {wall:.1f} s wall, {used:.1f} s CPU, with jax's import and the compile)"


if __name__ == "__main__":
    import jax

    attempts = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for flags in sys.argv[2:] or [""]:
        print(f"jax {jax.__version__}, {K} QRs of {S} x {M} x {R} float32{', one matrix at a time' * ONE_AT_A_TIME}, "
              f"XLA_FLAGS={flags!r}:", flush=True)
        for i in range(attempts):
            print(f"  attempt {i + 1}: {attempt(flags)}", flush=True)
