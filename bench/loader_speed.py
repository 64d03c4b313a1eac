"""Is the data loader ever the bottleneck? Each source's throughput against what a gpt2_124m step eats.

    python bench/loader_speed.py                                  # every loader, 24 MB corpus, byte tokens
    python bench/loader_speed.py --only memmap,hf_streaming --batches 50
    python bench/loader_speed.py --tokenizer ~/tok/gpt2 --corpus-mb 48 --data-dir /tmp/corpus   # a local HF tokenizer
    python bench/loader_speed.py --measure-cpu-step --batch-size 4   # also one real gpt2_124m step on this CPU (slow)

Why: a GPU step of gpt2_124m takes tens of milliseconds, and every loader must hand out its
batch well inside that, on one host thread, or the accelerator idles (`time/data_wait_sec` > 0).
The target (issue 11): every loader at least 10x faster than the step needs.

A synthetic corpus (Zipf-distributed pseudo-words, ~4.5 KB documents) is written once as .txt
files, as one .jsonl and as chat conversations (--data-dir keeps it; the default is a temporary
directory). For each loader the run's `Data` is built exactly as `train_jax.init_data` builds it,
from Hydra overrides of conf/ with model=gpt2_124m (context 1024) and dataset.batch_size:

- cold build: an empty cache_dir (and datasets cache): tokenize, write the token cache. memmap's
  is `write_dataset` (what scripts/prepare_data.py runs, every core) plus the build; mixture's
  components (text_files, the memmap prepared once, chat) are cold except that prepared memmap;
- warm build: the same again, caches hit (the files are in the OS page cache both times);
- tokens/s: `next(data.train)` with dataset.prefetch=0 (the raw loader, on this thread),
  `--batches` batches, median of `--repeats`; tokens counted as the step counts them (B x 1024);
- prefetch wait/step: dataset.prefetch as configured (2), the main thread sleeping a simulated
  step (--step-ms, default the H100 estimate) after each `next()`; the mean (and max) time `next()`
  blocked, the first fetch (thread start) excluded. The mean is what `time/data_wait_sec` logs.

Needed tokens/s = peak x MFU / FLOPs per token (models.flops_per_token, gpt2_124m with the
GPT-2 vocabulary padded to 50304), the assumption printed; margin = loader tokens/s / needed.
Timings on a shared machine are noisy: the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import train_jax as T
from loaders.pipeline import source_documents
from loaders.sources.memmap import write_dataset
from models import flops_per_token
from utils.config import compose_overrides, validate

LOADERS = ("memmap", "jsonl", "hf", "hf_streaming", "text_files", "chat", "mixture")
GPT2_VOCAB = 50304  # 50257 padded to a multiple of 64, as model.vocab_multiple does
TARGET_MARGIN = 10.0


def make_corpus(root: str, mb: float, seed: int = 0) -> dict:
    """~`mb` MB of documents as txt/*.txt and corpus.jsonl, ~mb/4 MB of chats.jsonl; reused if
    `root` already holds a corpus of these parameters."""
    stamp = os.path.join(root, "corpus.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info["mb"] == mb and info["seed"] == seed:
            return info
    rng = np.random.default_rng(seed)
    letters_26 = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters_26, n)) for n in rng.integers(2, 10, 4000)]
    zipf_V = 1.0 / np.arange(1, len(words) + 1)
    zipf_V /= zipf_V.sum()

    def text(n_words: int) -> str:
        out = [words[i] for i in rng.choice(len(words), n_words, p=zipf_V)]
        for i in range(14, n_words, 15):  # sentences of 15 words, paragraphs of 8 sentences
            out[i] += ".\n\n" if i % 120 == 119 else "."
        return " ".join(out)

    os.makedirs(os.path.join(root, "txt"), exist_ok=True)
    docs, size = [], 0
    while size < mb * 1e6:
        docs.append(text(int(rng.lognormal(np.log(650), 0.6)) + 20))
        size += len(docs[-1])
    for i, doc in enumerate(docs):
        with open(os.path.join(root, "txt", f"doc_{i:05d}.txt"), "w") as f:
            f.write(doc)
    with open(os.path.join(root, "corpus.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    chats, chat_size = [], 0
    while chat_size < mb * 1e6 / 4:
        turns = [{"role": "system", "content": text(12)}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 3))):  # most conversations fit one 1025-token window
            turns += [{"role": "user", "content": text(int(rng.integers(5, 25)))},
                      {"role": "assistant", "content": text(int(rng.integers(10, 60)))}]
        chats.append(json.dumps({"messages": turns}) + "\n")
        chat_size += len(chats[-1])
    with open(os.path.join(root, "chats.jsonl"), "w") as f:
        f.writelines(chats)
    info = {"mb": mb, "seed": seed, "documents": len(docs), "bytes": size, "chats": len(chats), "chat_bytes": chat_size}
    with open(stamp, "w") as f:
        json.dump(info, f)
    return info


def loader_overrides(name: str, data: str, memmap_dir: str) -> list[str]:
    txt, jsonl, chats = f"{data}/txt/*.txt", f"{data}/corpus.jsonl", f"{data}/chats.jsonl"
    mixed = (f"{{files: {{name: text_files, paths: ['{txt}'], weight: 0.5}}, "
             f"tokens: {{name: memmap, path: '{memmap_dir}', weight: 0.3}}, "
             f"chat: {{name: chat, path: json, data_files: ['{chats}'], weight: 0.2}}}}")
    return {
        "memmap": ["dataset=memmap", f"dataset.path={memmap_dir}"],
        "jsonl": ["dataset=jsonl", f"dataset.paths=[{jsonl}]"],
        "hf": ["dataset=hf", "dataset.path=json", f"dataset.data_files=[{jsonl}]"],
        "hf_streaming": ["dataset=hf", "dataset.path=json", f"dataset.data_files=[{jsonl}]", "dataset.streaming=true"],
        "text_files": ["dataset=text_files", f"dataset.paths=[{txt}]"],
        "chat": ["dataset=chat", "dataset.path=json", f"dataset.data_files=[{chats}]"],
        "mixture": ["dataset=mixture", "~dataset.components", f"+dataset.components={mixed}"],
    }[name]


def compose_run(overrides: list[str]):
    return validate(compose_overrides(overrides, "loader_speed"))


def build(run):
    """The run's Data as train_jax.build_trainer makes it (documents listed, tokenizer, init_data)."""
    docs = source_documents(run.dataset.source, run.tokenizer.needs_documents, run.config_dict["tokenizer"]["name"])
    return T.init_data(run, T.init_tokenizer(run, docs[0] if docs else None), docs)


def prepare_memmap(run, out: str) -> None:
    """What scripts/prepare_data.py does for dataset=text_files: the token files, every core."""
    train_docs, val_docs = run.dataset.source.documents()
    tok = run.tokenizer.build(train_docs, run.cache_dir)
    write_dataset(out, {"train": train_docs, "val": val_docs}, tok, os.cpu_count() or 1, progress_stream=io.StringIO(),
                  extra_meta={"tokenizer_config": run.config_dict.get("tokenizer")})


def secs(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def ensure_memmap(base: list[str], data_dir: str, out: str, cache: str) -> None:
    if not os.path.exists(out):
        prepare_memmap(compose_run([*base, *loader_overrides("text_files", data_dir, out), cache]), out)


def close(data) -> None:
    if hasattr(data.train, "close"):
        data.train.close()


def throughput(data, batches: int, repeats: int) -> float:
    """Median tokens/s of `batches` raw `next()` calls, over `repeats`."""
    next(data.train)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batches):
            next(data.train)
        rates.append(batches * data.tokens_per_step / (time.perf_counter() - t0))
    return statistics.median(rates)


def prefetch_wait(data, steps: int, step_s: float) -> tuple[float, float]:
    """(mean, max) seconds `next()` blocked while a simulated step of `step_s` ran after each batch."""
    next(data.train)  # starts the thread; a run pays this once, under the first compile
    waits = []
    for _ in range(steps):
        time.sleep(step_s)
        t0 = time.perf_counter()
        next(data.train)
        waits.append(time.perf_counter() - t0)
    return statistics.fmean(waits), max(waits)


def cpu_step_seconds(run, steps: int) -> float:
    """Median wall time of the real gpt2_124m train step on this CPU, synthetic tokens of the batch shape."""
    import jax

    from utils.parallel import mesh as meshlib

    trainer = T.build_trainer(run)
    shape = (run.dataset.accum_steps, run.dataset.batch_size, run.context_length + 1)
    tokens_AxBxW = np.random.default_rng(0).integers(0, trainer.tokenizer.vocab_size, shape, dtype=np.int32)
    batch = meshlib.put_batch(tokens_AxBxW, meshlib.batch_sharding(trainer.mesh, 1))
    state, times = trainer.state, []
    for i in range(steps + 1):  # the first call compiles
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        print(f"  cpu step {i}: {times[-1]:.1f} s{' (compile)' if i == 0 else ''}", flush=True)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(LOADERS), help="comma-separated loaders")
    parser.add_argument("--data-dir", default=None, help="where the corpus is written/reused (default: a temp dir)")
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--tokenizer", default="byte", help="byte, or a Hugging Face tokenizer (local dir or name)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=256,
                        help="timed next() calls per repeat: several of a stream's 512-document reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefetch-steps", type=int, default=80, help="simulated steps behind the prefetch thread")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
    parser.add_argument("--mfu", type=float, default=0.40)
    parser.add_argument("--step-ms", type=float, default=None, help="simulated step (default: the H100 estimate)")
    parser.add_argument("--measure-cpu-step", action="store_true")
    parser.add_argument("--cpu-steps", type=int, default=2)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(LOADERS)
    if unknown:
        parser.error(f"unknown loaders {sorted(unknown)}: choose from {', '.join(LOADERS)}")

    scratch = tempfile.TemporaryDirectory(prefix="loader_speed.")  # caches: always fresh, so cold is cold
    os.environ["HF_DATASETS_CACHE"] = os.path.join(scratch.name, "hf_datasets")  # before `datasets` is imported
    data_dir = os.path.abspath(os.path.expanduser(args.data_dir or os.path.join(scratch.name, "corpus")))
    memmap_dir = os.path.join(scratch.name, "memmap")
    tok = (["tokenizer=byte"] if args.tokenizer == "byte"
           else ["tokenizer=hf", f"tokenizer.name_or_path={args.tokenizer}"])
    base = ["model=gpt2_124m", f"dataset.batch_size={args.batch_size}", *tok]
    load0, started = os.getloadavg(), time.perf_counter()

    t0 = time.perf_counter()
    info = make_corpus(data_dir, args.corpus_mb)
    print(f"corpus: {info['bytes'] / 1e6:.1f} MB in {info['documents']:,} documents (txt files and one jsonl), "
          f"{info['chat_bytes'] / 1e6:.1f} MB in {info['chats']:,} chats; {time.perf_counter() - t0:.1f} s", flush=True)

    # What one step consumes, and how fast an H100 eats it.
    probe = compose_run([*base, "dataset=memmap", "dataset.path=unused"])
    model = dataclasses.replace(probe.model, vocab_size=GPT2_VOCAB)
    flops_tok = flops_per_token(model, probe.context_length)
    tokens_step = probe.dataset.accum_steps * args.batch_size * probe.context_length
    need_tok_s = args.peak_tflops * 1e12 * args.mfu / flops_tok
    h100_step_s = tokens_step / need_tok_s
    step_s = args.step_ms / 1e3 if args.step_ms is not None else h100_step_s
    print(f"gpt2_124m step: {tokens_step:,} tokens ({args.batch_size} x {probe.context_length}), "
          f"{flops_tok / 1e6:.1f} MFLOP/token (vocab {GPT2_VOCAB}); assumed H100 at {args.mfu:.0%} MFU of "
          f"{args.peak_tflops:.0f} TFLOP/s: {h100_step_s * 1e3:.1f} ms/step = {need_tok_s / 1e6:.2f}M tokens/s needed",
          flush=True)

    rows = {}
    for name in names:
        cache = [f"cache_dir={scratch.name}/cache-{name}"]
        run = compose_run([*base, *loader_overrides(name, data_dir, memmap_dir), *cache, "dataset.prefetch=0"])
        t0 = time.perf_counter()
        if name in ("memmap", "mixture"):
            ensure_memmap(base, data_dir, memmap_dir, cache[0])
            if name == "mixture":  # prepared once, not the mixture's cost
                t0 = time.perf_counter()
        close(build(run))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = build(run)
        warm = time.perf_counter() - t0
        rate = throughput(data, args.batches, args.repeats)
        close(data)
        prefetched = build(compose_run([*base, *loader_overrides(name, data_dir, memmap_dir), *cache]))
        wait, wait_max = prefetch_wait(prefetched, args.prefetch_steps, step_s)
        close(prefetched)
        rows[name] = (cold, warm, rate, wait, wait_max)
        print(f"{name}: cold {secs(cold)}, warm {secs(warm)}, {rate / 1e6:.2f}M tokens/s "
              f"({rate / need_tok_s:.0f}x), prefetch wait {wait * 1e3:.3f} ms/step "
              f"(max {wait_max * 1e3:.2f})", flush=True)

    cpu_step = None
    if args.measure_cpu_step:
        cache = f"cache_dir={scratch.name}/cache-cpu"
        ensure_memmap(base, data_dir, memmap_dir, cache)
        memmap_run = [*base, *loader_overrides("memmap", data_dir, memmap_dir), cache, f"model.vocab_size={GPT2_VOCAB}"]
        cpu_step = cpu_step_seconds(compose_run(memmap_run), args.cpu_steps)
        print(f"gpt2_124m step on this CPU: {cpu_step:.1f} s = {tokens_step / cpu_step:,.0f} tokens/s")

    load1 = os.getloadavg()
    print(f"\n{os.cpu_count()} cores ({platform.processor() or platform.machine()}), load average "
          f"{load0[0]:.2f} at start, {load1[0]:.2f} at end | {datetime.date.today()} | "
          f"{time.perf_counter() - started:.0f} s in all\n$ python {shlex.join(sys.argv)}")
    print(f"tokenizer {args.tokenizer}, batch {args.batch_size} x {probe.context_length}; needed: "
          f"{need_tok_s / 1e6:.2f}M tokens/s (H100, {args.mfu:.0%} MFU, {h100_step_s * 1e3:.0f} ms/step); "
          f"simulated step {step_s * 1e3:.0f} ms\n")
    cpu_col = " | margin vs this CPU's step" if cpu_step else ""
    print(f"| loader | cold build | warm build | tokens/s | margin vs H100 step{cpu_col} | prefetch wait/step |")
    print("| --- | --- | --- | --- | --- |" + (" --- |" if cpu_step else "") + " --- |")
    slow = []
    for name, (cold, warm, rate, wait, wait_max) in rows.items():
        margin = rate / need_tok_s
        if margin < TARGET_MARGIN:
            slow.append(name)
        flag = f" **below {TARGET_MARGIN:.0f}x**" if margin < TARGET_MARGIN else ""
        cpu = f" | {rate * cpu_step / tokens_step:,.0f}x" if cpu_step else ""
        print(f"| {name} | {secs(cold)} | {secs(warm)} | {rate / 1e6:.1f}M | {margin:,.0f}x{flag}{cpu} | "
              f"{wait * 1e3:.3f} ms (max {wait_max * 1e3:.2f}) |")
    print(f"\nbelow the {TARGET_MARGIN:.0f}x target: {', '.join(slow)}" if slow
          else f"\nevery loader is at least {TARGET_MARGIN:.0f}x faster than the step needs")
    scratch.cleanup()


if __name__ == "__main__":
    main()
