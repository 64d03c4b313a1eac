"""Train-step speed of the real pipeline: compile time, median step time, tokens/s and MFU.

    python bench/step_speed.py                          # gpt_bench, batch 16, synthetic vs real data
    python bench/step_speed.py model=gpt_tiny dataset.batch_size=32 --steps 20
    python bench/step_speed.py model=gpt2_124m train.compute_dtype=bfloat16 dataset.batch_size=16   # GPU

Arguments other than --steps/--warmup/--data are Hydra overrides of conf/config.yaml, so the
step measured is exactly the one `train_jax.py` compiles. MFU is printed two ways: 6·N (the
parameter count convention of the README's table) and 6·N + attention (what train/mfu logs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import train_jax as T  # noqa: E402
from models.gpt import count_params, flops_per_token, param_labels, GPT  # noqa: E402
from utils import mesh as meshlib  # noqa: E402
from utils.config import validate  # noqa: E402
from utils.flops import peak_flops  # noqa: E402


def time_steps(step_fn, state, batches, steps: int, warmup: int):
    t0 = time.perf_counter()
    state, metrics = step_fn(state, next(batches))
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, metrics = step_fn(state, next(batches))
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, next(batches))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, compile_s, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--data", choices=("both", "synthetic", "real"), default="both")
    args, overrides = parser.parse_known_args()
    overrides = ["model=gpt_bench", "dataset.batch_size=16", *overrides]
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        run = validate(compose("config", overrides=overrides))

    mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)
    docs = T.load_documents(run)
    tokenizer = T.init_tokenizer(run, docs[0])
    run = T.resolve_vocab(run, tokenizer)
    data = T.init_data(run, tokenizer, docs)
    schedule = T.init_scheduler(run)
    labels = param_labels(jax.eval_shape(lambda: GPT(run.model, jax.random.PRNGKey(0))))
    tx = T.init_optimizer(run, schedule, labels)
    state, shardings = T.init_state(run, tx, mesh)
    step_fn = T.make_train_step(run, tx, schedule, shardings, mesh)
    sharding = meshlib.batch_sharding(mesh, 1)

    flops_full = flops_per_token(run.model, run.context_length) * data.tokens_per_step
    flops_6n = 6 * count_params(state.model) * data.tokens_per_step
    peak = peak_flops(run.train.compute_dtype, run.cache_dir)
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} | peak {peak / 1e9:,.0f} GFLOP/s "
          f"| params {count_params(state.model) / 1e6:.2f}M | tokens/step {data.tokens_per_step:,} "
          f"| {run.train.compute_dtype} | scan={run.model.scan_blocks} remat={run.model.remat}")

    def synthetic():
        rng = np.random.default_rng(0)
        shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
        batch = rng.integers(0, tokenizer.vocab_size, shape, dtype=np.int32)
        while True:
            yield meshlib.put_batch(batch, sharding)

    def real():
        while True:
            yield meshlib.put_batch(next(data.train), sharding)

    medians = {}
    for name, source in (("synthetic", synthetic), ("real", real)):
        if args.data not in ("both", name):
            continue
        state, compile_s, times = time_steps(step_fn, state, source(), args.steps, args.warmup)
        med = statistics.median(times)
        medians[name] = med
        print(f"{name:>9}: compile {compile_s:6.2f} s | step {med * 1e3:8.1f} ms (min {min(times) * 1e3:.1f}) | "
              f"{data.tokens_per_step / med:10,.0f} tokens/s | MFU(6N) {flops_6n / med / peak:6.1%} | "
              f"MFU(6N+attn) {flops_full / med / peak:6.1%}")
    if len(medians) == 2:
        print(f"real loader overhead: {medians['real'] / medians['synthetic'] - 1:+.1%}")


if __name__ == "__main__":
    main()
