"""eqtrain's single entry point: `python train_jax.py [hydra overrides]`.

Reads as the recipe it runs: validate the config; build tokenizer, data, model, schedule and
optimizer; compile one sharded, buffer-donating train step; run the host loop that logs,
evaluates and finally samples a little text.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from loaders.batching import BatchIterator, WindowDataset, eval_batches, tokenize_documents
from models.gpt import GPT, count_params, cross_entropy, flops_per_token, param_labels
from models.sample import generate, printable
from optimizer import group_schedules, make_optimizer
from optimizer.restart import schedules_at
from utils import checkpoint as ckptlib
from utils import mesh as meshlib
from utils.config import RunConfig, to_dict, validate
from utils.errors import ConfigError, EqtrainError, TrainingError
from utils.flops import peak_flops
from utils.metrics import RunLogger, file_log


# ----------------------------------------------------------------------------- components


def load_documents(run: RunConfig) -> tuple[corpus.Documents, corpus.Documents]:
    """(train, val): files listed and stat-fingerprinted now, read on first access, so a run whose
    tokenizer and token caches hit never reads the corpus."""
    d = run.dataset
    return corpus.split_documents(d.name, d.val_fraction, d.include_tests, d.paths, d.text_key)


def init_tokenizer(run: RunConfig, train_docs: Sequence[str]) -> tokenizers.Tokenizer:
    t = run.tokenizer
    if t.name == "byte":
        return tokenizers.byte_tokenizer()
    if t.name == "bpe":
        cache_dir = os.path.expanduser(run.cache_dir)
        return tokenizers.corpus_bpe_tokenizer(t.vocab_size, train_docs, t.sample_docs, cache_dir)
    return tokenizers.hf_tokenizer(t.name_or_path)


@dataclass
class Data:
    train: BatchIterator  # yields this process's rows of (accum_steps, batch_size, T+1)
    val: WindowDataset  # evaluate() scores a fixed seeded subset of it (loaders.batching.eval_indices)
    tokens_per_step: int


def init_data(run: RunConfig, tokenizer: tokenizers.Tokenizer, docs: tuple[Sequence[str], Sequence[str]]) -> Data:
    """Token caches are keyed by the tokenizer's fingerprint (not its name: two BPEs share one) and the
    split's stat fingerprint, so a hit reads no corpus text and a retrained tokenizer never reuses ids."""
    d, window = run.dataset, run.context_length + 1
    cache_dir = os.path.join(os.path.expanduser(run.cache_dir), "tokens")

    def windows(split_docs: Sequence[str], split: str) -> WindowDataset:
        split_docs = corpus.in_memory_documents(split_docs)  # a lazy corpus.Documents passes through unread
        readable = tokenizer.name.replace("/", "_").replace(":", "_")
        name = f"{d.name}-{split}-{readable}-{tokenizer.fingerprint}-{split_docs.fingerprint}.npy"
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
    else:  # checkpoint.overwrite_optimizer: a fresh state of this run's optimizer for the restored weights,
        # its lr schedule continuing at the restored step
        fresh = lambda params, step: schedules_at(tx.init(params), step)  # noqa: E731
        opt_state = jax.jit(fresh, out_shardings=shardings.opt_state)(eqx.filter(model, eqx.is_array),
                                                                       restored["progress"]["step"])
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
    """Weighted sums, not means: padding rows weigh 0 and batches add up, so evaluate() averages over
    real windows only."""
    compute_dtype = jnp.dtype(run.train.compute_dtype)

    def eval_step(model: GPT, tokens_BxT1: jax.Array, weights_B: jax.Array):
        # Per window: cross_entropy averages over its batch, so map it over single rows.
        loss_B, correct_B = jax.vmap(lambda t_T1: cross_entropy(model, t_T1[None], None, compute_dtype))(tokens_BxT1)
        return (weights_B * loss_B).sum(), (weights_B * correct_B).sum(), weights_B.sum()

    return eqx.filter_jit(eval_step)


def evaluate(eval_step: Callable, model: GPT, val: WindowDataset, run: RunConfig, batch_sharding) -> dict[str, float]:
    """Mean loss/accuracy over min(len(val), max_val_steps·batch_size) validation windows, each once,
    drawn by a fixed seed (not random_seed): the same windows at every evaluation, resume and seed of a
    sweep, so evaluations compare; random, so not just the first files'."""
    weights_sharding = meshlib.row_sharding(batch_sharding)
    batches = eval_batches(val, run.dataset.batch_size, run.train.max_val_steps,
                           process_index=jax.process_index(), process_count=jax.process_count())
    put = meshlib.put_batch
    sums = [eval_step(model, put(tokens_BxT1, batch_sharding), put(weights_B, weights_sharding))
            for tokens_BxT1, weights_B in batches]  # all dispatched before the first value is pulled
    loss_sum, correct_sum, windows = (sum(float(s[i]) for s in sums) for i in range(3))
    loss = loss_sum / windows
    accuracy = correct_sum / (windows * (val.window - 1))
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/accuracy": accuracy}


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


# The host loop's clock (a seam: tests drive it to check the throughput arithmetic exactly).
clock = time.perf_counter


def check_finite(record: dict[str, float], step: int) -> None:
    """Stop a diverged run before it logs on or saves: a NaN state written at an interval or on
    preemption would push good checkpoints out under max_to_keep and be resumed from. The loss
    vouches for the weights the step started from, the update's norm for the ones it produced."""
    for name in ("train/loss", "aux/update_norm"):
        value = record.get(name, 0.0)
        if not math.isfinite(value):
            raise TrainingError(f"{name} is {value} at step {step}: the run diverged; "
                                "lower optimizer.lr_config.lr or set train.gradient_clip_val")


def warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}", flush=True)
        file_log.warning(f"warning: {message}")


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
            t_last, step_last = clock(), start
            for step in range(start + 1, end + 1):
                batch = meshlib.put_batch(next(data.train), batch_sharding)
                state, metrics = train_step(state, batch)  # dispatched; the host moves on at once
                log.advance()
                record: dict[str, float] = {}
                if step % run.logging.log_every == 0 or step == end:
                    record = {k: float(v) for k, v in metrics.items()}  # the only device sync on training steps
                    now = clock()
                    if step_last > start or step == end:  # the first interval holds compilation
                        seconds = (now - t_last) / (step - step_last)
                        record["train/step_time"] = seconds
                        record["train/tokens_per_sec"] = data.tokens_per_step / seconds
                        record["train/mfu"] = flops_per_step / seconds / peak if peak else float("nan")
                    t_last, step_last = now, step
                if validate_now(step):
                    record.update(evaluate(eval_step, state.model, data.val, run, eval_sharding))
                    # Evaluation time is not training throughput: the next interval starts after it.
                    t_last, step_last = clock(), step
                if record:
                    log.log(step, record)
                    last.update(record)
                    check_finite(record, step)
                if saver is None:
                    continue
                due = saver.due(step) or step == end
                signame = ckptlib.agree(stop.requested, sync_point=bool(record))
                if (due or signame) and not record:
                    check_finite({k: float(metrics[k]) for k in ("train/loss", "aux/update_norm")}, step)
                if "val/loss" in record and saver.maybe_save_best(step, state, data.train.state_dict(), last):
                    log.print(f"checkpoint: new best val/loss {record['val/loss']:.4f}, saving {ck.save_path}/best")
                if due:
                    save(step, "end" if step == end else "scheduled")
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
                       run.train.sample_temperature, stop_id=tokenizer.eot_id, context_length=run.context_length)
        if jax.process_index() == 0:
            text = "---- sample ----\n" + printable(tokenizer.decode(ids)) + "\n----------------"
            print(text, flush=True)
            file_log.info(text)
    return last


def train(cfg: DictConfig | dict, run_dir: str) -> dict[str, float]:
    """What `main` does once Hydra has composed the config (tests call it in-process): pick the
    checkpoint to start from, settle which config wins, validate, train."""
    config_dict = to_dict(cfg)
    run = validate(config_dict)  # every knob of this command line is checked before any file is touched
    meshlib.init_distributed()  # before anything asks jax which process this is
    source = ckptlib.resume_source(run.checkpoint, warn)
    if source is not None:
        config_dict = ckptlib.merge_config(source, config_dict, run.checkpoint, warn)
        run = validate(config_dict)
    return run_training(run, run_dir, config_dict, source)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    from hydra.core.hydra_config import HydraConfig

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" probe noise
    hydra_cfg = HydraConfig.get()
    try:
        return train(cfg, hydra_cfg.runtime.output_dir)
    except ckptlib.Preempted as e:
        print(f"eqtrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except EqtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
