"""eqtrain's single entry point: `python train_jax.py [hydra overrides]`.

Reads as the recipe it runs: validate the config; build tokenizer, data, model, schedule and
optimizer; compile one sharded, buffer-donating train step; run the host loop that logs,
evaluates and finally samples a little text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import equinox as eqx
import hydra
import jax
import jax.numpy as jnp
import numpy as np
import optax
from omegaconf import DictConfig

from loaders import corpus, tokenizers
from loaders.batching import BatchIterator, WindowDataset, tokenize_documents
from models.gpt import GPT, count_params, cross_entropy, flops_per_token, param_labels
from models.sample import generate
from optimizer import group_schedules, make_optimizer
from utils import checkpoint as ckptlib
from utils import mesh as meshlib
from utils.config import RunConfig, to_dict, validate
from utils.errors import ConfigError, EqtrainError, TrainingError
from utils.flops import peak_flops
from utils.metrics import RunLogger


# ----------------------------------------------------------------------------- components


def load_documents(run: RunConfig) -> tuple[list[str], list[str]]:
    d = run.dataset
    if d.name == "stdlib":
        return tuple(corpus.stdlib_documents(s, d.val_fraction, d.include_tests) for s in ("train", "val"))
    return tuple(corpus.text_file_documents(list(d.paths), s, d.val_fraction, d.text_key) for s in ("train", "val"))


def init_tokenizer(run: RunConfig, train_docs: list[str]) -> tokenizers.Tokenizer:
    t = run.tokenizer
    if t.name == "byte":
        return tokenizers.byte_tokenizer()
    if t.name == "bpe":
        return tokenizers.bpe_tokenizer(t.vocab_size, lambda: train_docs[: t.sample_docs], os.path.expanduser(run.cache_dir))
    return tokenizers.hf_tokenizer(t.name_or_path)


@dataclass
class Data:
    train: BatchIterator  # yields this process's rows of (accum_steps, batch_size, T+1)
    val: WindowDataset  # read in order from the start at every evaluation
    tokens_per_step: int


def init_data(run: RunConfig, tokenizer: tokenizers.Tokenizer, docs: tuple[list[str], list[str]]) -> Data:
    d, window = run.dataset, run.context_length + 1
    cache_dir = os.path.join(os.path.expanduser(run.cache_dir), "tokens")

    def windows(split_docs: list[str], split: str) -> WindowDataset:
        digest = hashlib.md5("\x00".join(split_docs).encode("utf-8", "replace")).hexdigest()[:16]
        name = f"{d.name}-{split}-{tokenizer.name.replace('/', '_').replace(':', '_')}-{digest}.npy"
        return WindowDataset(tokenize_documents(split_docs, tokenizer, os.path.join(cache_dir, name)), window)

    train = BatchIterator(windows(docs[0], "train"), (d.accum_steps, d.batch_size), run.random_seed, d.shuffle,
                          jax.process_index(), jax.process_count())
    return Data(train, windows(docs[1], "val"), d.accum_steps * d.batch_size * run.context_length)


def resolve_vocab(run: RunConfig, tokenizer: tokenizers.Tokenizer) -> RunConfig:
    """model.vocab_size null -> the tokenizer's, padded to model.vocab_multiple."""
    m = run.model
    if m.vocab_size is None:
        padded = -(-tokenizer.vocab_size // m.vocab_multiple) * m.vocab_multiple
        return dataclasses.replace(run, model=dataclasses.replace(m, vocab_size=padded))
    if m.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
                          "ids: raise it or set it to null")
    return run


def init_model(run: RunConfig, key: jax.Array) -> GPT:
    dtype = jnp.dtype(run.train.param_dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, GPT(run.model, key))


def init_scheduler(run: RunConfig) -> optax.Schedule:
    return run.optimizer.schedule.build(run.optimizer.schedule_steps)


def init_optimizer(run: RunConfig, schedule: optax.Schedule, labels) -> optax.GradientTransformation:
    o = run.optimizer
    return make_optimizer(o.hparams, schedule, labels, run.train.gradient_clip_val, o.schedule.lr, o.group_overrides)


# ----------------------------------------------------------------------------- state and steps


class TrainState(eqx.Module):
    model: GPT
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer updates done
    key: jax.Array  # uint32[2]: dropout randomness, split once per step


def init_state(run: RunConfig, tx: optax.GradientTransformation, mesh,
               source: ckptlib.Source | None = None) -> tuple[TrainState, object]:
    """Build the state directly into its shards (no host copy of the full model), or restore it
    from `source` straight into the same shards."""

    def build() -> TrainState:
        model_key, train_key = jax.random.split(jax.random.PRNGKey(run.random_seed))
        model = init_model(run, model_key)
        return TrainState(model, tx.init(eqx.filter(model, eqx.is_array)), jnp.zeros((), jnp.int32), train_key)

    abstract = jax.eval_shape(build)
    shardings = meshlib.tree_shardings(mesh, abstract)
    if source is None:
        return jax.jit(build, out_shardings=shardings)(), shardings
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    restored = ckptlib.restore(source, target, dataclasses.asdict(run.model))
    model = restored["model"]
    if "opt_state" in restored:
        opt_state = restored["opt_state"]
    else:  # checkpoint.overwrite_optimizer: a fresh state of this run's optimizer for the restored weights
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(eqx.filter(model, eqx.is_array))
    return TrainState(model, opt_state, restored["progress"]["step"], restored["progress"]["key"]), shardings


def make_train_step(run: RunConfig, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    state_shardings, mesh) -> Callable:
    """One jitted update: gradient accumulation as a scan over micro-batches, clipping and the
    optimizer inside `tx`, metrics returned as device arrays (pulled only on logging steps)."""
    compute_dtype = jnp.dtype(run.train.compute_dtype)
    grad_fn = eqx.filter_value_and_grad(cross_entropy, has_aux=True)
    o = run.optimizer
    lr_by_group = group_schedules(o.hparams, schedule, o.schedule.lr, o.group_overrides)
    if run.model.tie_embeddings:
        lr_by_group.pop("head")  # no such parameter

    def train_step(state: TrainState, batch_AxBxT1: jax.Array):
        key, step_key = jax.random.split(state.key)
        micro_keys = jax.random.split(step_key, batch_AxBxT1.shape[0])
        use_dropout = run.model.dropout > 0

        def micro(grads_sum, xs):
            tokens_BxT1, k = xs
            (loss, _), grads = grad_fn(state.model, tokens_BxT1, k if use_dropout else None, compute_dtype)
            return jax.tree.map(jnp.add, grads_sum, grads), loss

        accum = batch_AxBxT1.shape[0]
        if accum == 1:  # no loop, no zero-filled accumulator: XLA fuses the step end to end
            (loss, _), grads = grad_fn(state.model, batch_AxBxT1[0], micro_keys[0] if use_dropout else None,
                                       compute_dtype)
            losses_A = loss[None]
        else:
            zeros = jax.tree.map(jnp.zeros_like, eqx.filter(state.model, eqx.is_array))
            grads_sum, losses_A = jax.lax.scan(micro, zeros, (batch_AxBxT1, micro_keys))
            grads = jax.tree.map(lambda g: g / accum, grads_sum)
        params = eqx.filter(state.model, eqx.is_array)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        model = eqx.apply_updates(state.model, updates)
        metrics = {
            "train/loss": losses_A.mean(),
            "train/grad_norm": optax.tree.norm(grads),
            "train/lr": schedule(state.step),
            **{f"train/lr/{g}": s(state.step) for g, s in lr_by_group.items()},
            "aux/param_norm": optax.tree.norm(params),
            "aux/update_norm": optax.tree.norm(updates),
        }
        return TrainState(model, opt_state, state.step + 1, key), metrics

    return jax.jit(train_step, in_shardings=(state_shardings, meshlib.batch_sharding(mesh, 1)),
                   out_shardings=(state_shardings, meshlib.replicated(mesh)), donate_argnums=0)


def make_eval_step(run: RunConfig) -> Callable:
    compute_dtype = jnp.dtype(run.train.compute_dtype)

    def eval_step(model: GPT, tokens_BxT1: jax.Array):
        loss, correct = cross_entropy(model, tokens_BxT1, None, compute_dtype)
        return loss, correct / tokens_BxT1[:, 1:].size

    return eqx.filter_jit(eval_step)


def evaluate(eval_step: Callable, model: GPT, val: WindowDataset, run: RunConfig, batch_sharding) -> dict[str, float]:
    """Mean loss/accuracy over the first `max_val_steps` batches of the validation split (the
    same windows every time, so evaluations compare)."""
    it = BatchIterator(val, (run.dataset.batch_size,), run.random_seed, False, jax.process_index(), jax.process_count())
    steps = min(run.train.max_val_steps, max(len(val) // run.dataset.batch_size, 1))
    results = [eval_step(model, meshlib.put_batch(next(it), batch_sharding)) for _ in range(steps)]
    loss, acc = (float(np.mean([float(r[i]) for r in results])) for i in (0, 1))
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/accuracy": acc}


# ----------------------------------------------------------------------------- the run


@dataclass
class Trainer:
    """Everything a run builds before its first step; benchmarks and tests build the same."""

    run: RunConfig  # with model.vocab_size resolved from the tokenizer
    mesh: jax.sharding.Mesh
    tokenizer: tokenizers.Tokenizer
    data: Data
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    state: TrainState
    train_step: Callable
    eval_step: Callable


def build_trainer(run: RunConfig, source: ckptlib.Source | None = None) -> Trainer:
    meshlib.init_distributed()
    mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)
    docs = load_documents(run)
    tokenizer = init_tokenizer(run, docs[0])
    run = resolve_vocab(run, tokenizer)
    data = init_data(run, tokenizer, docs)
    if source is not None:
        data.train.load_state_dict(source.manifest["data"])
    schedule, tx, state, train_step = init_training(run, mesh, source)
    return Trainer(run, mesh, tokenizer, data, schedule, tx, state, train_step, make_eval_step(run))


def init_training(run: RunConfig, mesh, source: ckptlib.Source | None = None
                  ) -> tuple[optax.Schedule, optax.GradientTransformation, TrainState, Callable]:
    """Schedule, optimizer, sharded initial (or restored) state and the compiled-on-first-call
    train step (model.vocab_size must be resolved)."""
    schedule = init_scheduler(run)
    tx = init_optimizer(run, schedule, param_labels(eqx.filter_eval_shape(GPT, run.model, jax.random.PRNGKey(0))))
    state, shardings = init_state(run, tx, mesh, source)
    return schedule, tx, state, make_train_step(run, tx, schedule, shardings, mesh)


def warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}", flush=True)


def run_training(run: RunConfig, run_dir: str, config_dict: dict | None = None,
                 source: ckptlib.Source | None = None) -> dict[str, float]:
    """Everything after validation: train from step 0 or from `source` up to train.max_steps
    (or checkpoint.num_steps more), saving checkpoints as configured. Returns the merged metrics
    of the run (handy for tests); raises ckptlib.Preempted after saving on SIGTERM/SIGUSR1/SIGINT."""
    trainer = build_trainer(run, source)
    run, data, state, tokenizer = trainer.run, trainer.data, trainer.state, trainer.tokenizer
    train_step, eval_step, mesh = trainer.train_step, trainer.eval_step, trainer.mesh
    ck = run.checkpoint
    start = int(state.step)
    end = min(run.train.max_steps, start + ck.num_steps) if ck.num_steps else run.train.max_steps

    n_params = count_params(state.model)
    flops_per_step = flops_per_token(run.model, run.context_length) * data.tokens_per_step
    peak = peak_flops(run.train.compute_dtype, run.cache_dir)
    log = RunLogger(run.logging, run_dir, run.train.max_steps, start, config_dict)
    log.print(f"eqtrain: {n_params / 1e6:.2f}M params | {run.optimizer.name} + {run.optimizer.schedule_name} | "
              f"{data.tokens_per_step:,} tokens/step | {len(jax.devices())} {jax.devices()[0].platform} device(s) "
              f"| run dir {run_dir}")

    for warning in run.warnings:
        log.print(f"warning: {warning}")
    if source is not None:
        log.print(f"resumed from {source.path} at step {start}"
                  + ("" if source.with_opt_state else " with a fresh optimizer state (checkpoint.overwrite_optimizer)"))
    if start >= run.train.max_steps:
        log.print(f"nothing to train: the run is at step {start} = train.max_steps")
        log.close()
        return dict(source.manifest.get("metrics", {})) if source else {}

    batch_sharding, eval_sharding = meshlib.batch_sharding(mesh, 1), meshlib.batch_sharding(mesh, 0)

    def validate_now(step: int) -> bool:
        t = run.train
        due = (step == 0 and t.val_at_start) or step % t.val_freq == 0 or step == t.max_steps
        return due and not t.skip_validation

    last: dict[str, float] = {}
    if start == 0 and validate_now(0):
        last = evaluate(eval_step, state.model, data.val, run, eval_sharding)
        log.log(0, last)

    saver = ckptlib.Checkpointer(ck, config_dict or {}, dataclasses.asdict(run.model), warn) if ck.save else None

    def save(step: int, reason: str) -> None:
        if saver.save(step, state, data.train.state_dict(), last, reason):
            log.print(f"checkpoint: saving {ck.save_path}/{ckptlib.STEP_PREFIX}_{step} ({reason})")

    with ckptlib.StopSignals(catch_interrupt=ck.save_on_interrupt) if saver else contextlib.nullcontext() as stop:
        try:
            t_last, step_last = time.perf_counter(), start
            for step in range(start + 1, end + 1):
                batch = meshlib.put_batch(next(data.train), batch_sharding)
                state, metrics = train_step(state, batch)  # dispatched; the host moves on at once
                log.advance()
                record: dict[str, float] = {}
                if step % run.logging.log_every == 0 or step == end:
                    record = {k: float(v) for k, v in metrics.items()}  # the only device sync on training steps
                    now = time.perf_counter()
                    if step_last > start or step == end:  # the first interval holds compilation
                        seconds = (now - t_last) / (step - step_last)
                        record["train/step_time"] = seconds
                        record["train/tokens_per_sec"] = data.tokens_per_step / seconds
                        record["train/mfu"] = flops_per_step / seconds / peak if peak else float("nan")
                    t_last, step_last = now, step
                if validate_now(step):
                    record.update(evaluate(eval_step, state.model, data.val, run, eval_sharding))
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                if record:
                    log.log(step, record)
                    last.update(record)
                    if not math.isfinite(record.get("train/loss", 0.0)):
                        raise TrainingError(f"train/loss is {record['train/loss']} at step {step}: the run diverged; "
                                            "lower optimizer.lr_config.lr or set train.gradient_clip_val")
                if saver is None:
                    continue
                if "val/loss" in record and saver.maybe_save_best(step, state, data.train.state_dict(), last):
                    log.print(f"checkpoint: new best val/loss {record['val/loss']:.4f}, saving {ck.save_path}/best")
                if saver.due(step) or step == end:
                    save(step, "end" if step == end else "scheduled")
                signame = ckptlib.agree(stop.requested, sync_point=bool(record))
                if signame and step < end:  # at the end the run is done and saved: it just finishes
                    save(step, signame)  # finished by saver.close() below before the process exits
                    raise ckptlib.Preempted(signame, step, f"{ck.save_path}/{ckptlib.STEP_PREFIX}_{step}")
        finally:  # inside the handlers: a second SIGTERM cannot kill a save that is still being written
            if saver is not None:
                saver.close()  # pending asynchronous writes finish before the process may exit
            log.close()

    if run.train.sample_tokens:
        prompt = tokenizer.encode(run.train.sample_prompt)
        ids = generate(state.model, prompt, run.train.sample_tokens, jax.random.PRNGKey(run.random_seed),
                       run.train.sample_temperature, stop_id=tokenizer.eot_id)
        if jax.process_index() == 0:
            print("---- sample ----\n" + tokenizer.decode(ids) + "\n----------------", flush=True)
    return last


def train(cfg: DictConfig | dict, run_dir: str, overrides: Sequence[str] = ()) -> dict[str, float]:
    """What `main` does once Hydra has composed the config (tests call it in-process): pick the
    checkpoint to start from, settle which config wins, validate, train."""
    config_dict = to_dict(cfg)
    run = validate(config_dict)  # every knob of this command line is checked before any file is touched
    meshlib.init_distributed()  # before anything asks jax which process this is
    source = ckptlib.resume_source(run.checkpoint, warn)
    if source is not None:
        config_dict = ckptlib.merge_config(source, config_dict, overrides, run.checkpoint, warn)
        run = validate(config_dict)
    return run_training(run, run_dir, config_dict, source)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    from hydra.core.hydra_config import HydraConfig

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" probe noise
    hydra_cfg = HydraConfig.get()
    try:
        return train(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task))
    except ckptlib.Preempted as e:
        print(f"eqtrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except EqtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
