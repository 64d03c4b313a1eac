"""eqtrain's single entry point: `python train_jax.py [hydra overrides]`.

Reads as the recipe it runs: validate the config; build tokenizer, data, model, schedule and
optimizer; compile one sharded, buffer-donating train step; run the host loop, whose periodic
jobs (logging, evaluation, checkpoints, sampling) are hooks (trainer/hooks.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # XLA:CPU's step buffer on 2 MiB pages (re-executes: before jax loads, it costs nothing)
    from utils.host_memory import use_huge_pages
    use_huge_pages(__file__)

import contextlib
import dataclasses
import functools
import sys
from typing import Callable, Sequence

import equinox as eqx
import hydra
import jax
import jax.numpy as jnp
import optax
from omegaconf import DictConfig

import models
from loaders.batching import eval_batches
from loaders.config import DataRequest
from loaders.pipeline import Data, build_data, source_documents, source_windows
from loaders.tokenizers import Tokenizer
from loaders.windows import WindowDataset
from models import hf_generation, lora
from models.sample import sampler
from optimizer import arguments, diagnostics, eval_view, group_schedules, make_optimizer
from optimizer.nonfinite import skip_nonfinite
from optimizer.restart import fresh_state
from trainer import aux_state, early_stopping, loss_scale, memory, precompile, step_metrics, tasks, weight_average
from trainer import hooks as H
from trainer import process_cache as shared
from trainer.activations import ActivationNorms
from trainer.flops import peak_flops
from trainer.header import announce
from trainer.resume import frozen_base, merge_config, restore_state, resume_source
from trainer.run_export import Export as RunExport
from trainer.step import TrainState, build_train_step, initial_keys
from trainer.trainer import Trainer
from utils import cli
from utils.checkpoint.signals import Preempted, StopSignals
from utils.checkpoint.storage import Checkpointer, Source, step_path
from utils.config import RunConfig, resolve_vocab, to_dict, validate
from utils.logging.messages import say, warn
from utils.logging.sinks import open_sinks
from utils.parallel import layout
from utils.parallel import mesh as meshlib


def init_tokenizer(run: RunConfig, train_docs: Sequence[str] | None) -> Tokenizer:
    return run.tokenizer.build(train_docs, run.cache_dir)


def init_data(run: RunConfig, tokenizer: Tokenizer, docs=None, state: dict | None = None) -> Data:
    """Batches in data_seed's order (prefetched, this process's rows), resumed at `state`; the windows
    are built once per comparison process (trainer/process_cache.py)."""
    req = DataRequest(tokenizer, run.cache_dir, run.context_length + 1, run.dataset.document_mask)
    windows = shared.remember(  # fixed-size windows only: a stream (hf, streaming) is opened by each run
        "windows", (*shared.data_key(run), req.window, req.document_mask),
        lambda: source_windows(run.dataset.source, req, docs), keep=lambda w: isinstance(w[0], WindowDataset))
    return build_data(run.dataset, req, run.data_seed, jax.process_index(), jax.process_count(), docs, state, windows)


def init_model(run: RunConfig, key: jax.Array) -> eqx.Module:
    return models.build(run.model, key, run.train.param_dtype)


def init_scheduler(run: RunConfig) -> optax.Schedule:
    return run.optimizer.schedule.build(run.optimizer.schedule_steps)


def init_optimizer(run: RunConfig, schedule: optax.Schedule, labels) -> optax.GradientTransformation:
    o, t = run.optimizer, run.train
    tx = make_optimizer(o.hparams, schedule, labels, t.gradient_clip_val, o.schedule.lr, o.group_overrides, o.cautious,
                        o.hyperball, o.lr_scales)
    # A non-finite gradient leaves weights and optimizer state as they were (trainit's apply_if_finite);
    # the lr schedule still follows the step (optimizer/nonfinite.py).
    return skip_nonfinite(tx, t.max_consecutive_skips) if t.skip_nonfinite else tx


def init_state(run: RunConfig, tx: optax.GradientTransformation, mesh, metrics=(), source: Source | None = None,
               shapes_key: str | None = None):
    """(state, its shardings): built or restored (`source`) straight into its shards; `metrics`' states beside it.
    `shapes_key`: what determines the state's shapes (a comparison process traces them once per key)."""
    init_metrics = lambda m: step_metrics.init_states(metrics, eqx.filter(m, eqx.is_inexact_array))

    def build(keys) -> TrainState:
        model_key, train_key = keys
        model = init_model(run, model_key)
        return TrainState(model, tx.init(eqx.filter(model, eqx.is_array)), jnp.zeros((), jnp.int32), train_key,
                          init_metrics(model), loss_scale.initial(run.train))

    # The keys are the program's argument, not its constants: one initialisation program serves every seed.
    keys = initial_keys(run.random_seed)
    abstract = shared.remember("abstract_state", shapes_key, lambda: jax.eval_shape(build, keys)) \
        if shapes_key is not None else jax.eval_shape(build, keys)
    shardings = layout.state_shardings(mesh, abstract, abstract.model, models.param_axes(abstract.model),
                                       zero1=run.parallel.shard_optimizer_state)
    if source is None:
        return jax.jit(build, out_shardings=shardings)(keys), shardings
    return restore_state(source, abstract, shardings, dataclasses.asdict(run.model), build, keys,
                         lambda m, step: fresh_state(tx, eqx.filter(m, eqx.is_array), step, shardings.opt_state),
                         jax.jit(init_metrics, out_shardings=shardings.metric_states)), shardings


def make_evaluate(run: RunConfig, val: WindowDataset, mesh, eval_step: Callable | None = None
                  ) -> Callable[[eqx.Module], dict[str, float]]:
    """model -> val/loss, perplexity, accuracy over min(len(val), max_val_steps·batch_size) windows, each once, drawn
    by a fixed seed (not random_seed): the same windows at every evaluation, resume and sweep seed, so they compare."""
    eval_step = eval_step or H.evaluation_step(run.objective, run.train.compute_dtype)  # mdlm: fixed seeded masks
    batches = functools.partial(eval_batches, val, run.dataset.batch_size, run.train.max_val_steps,
                                process_index=jax.process_index(), process_count=jax.process_count())
    if shared.active():  # read once per comparison process; the entry holds `val`, so its id stays its own
        key = (id(val), run.dataset.batch_size, run.train.max_val_steps, jax.process_index(), jax.process_count())
        kept = shared.remember("eval_batches", key, lambda: (val, list(batches())))[1]
        batches = lambda: iter(kept)
    return H.evaluator(eval_step, mesh, batches)


def build_trainer(run: RunConfig, source: Source | None = None, schedule: optax.Schedule | None = None) -> Trainer:
    p = run.parallel
    meshlib.init_distributed(p.distributed)
    mesh = meshlib.make_mesh(p.data, p.fsdp, run.dataset.batch_size, tensor=p.tensor, expert=p.expert)
    def start():  # once per comparison process (trainer/process_cache.py)
        docs = source_documents(run.dataset.source, run.tokenizer.needs_documents, run.config_dict["tokenizer"]["name"])
        return docs, init_tokenizer(run, docs[0] if docs else None)

    docs, tokenizer = shared.remember("tokenizer", shared.data_key(run), start)
    run = resolve_vocab(run, tokenizer.vocab_size)
    score_tasks = tasks.scorer(run, tokenizer, mesh)  # eval.tasks read and checked before anything compiles
    check_memory(run, mesh)  # before the data is read and anything compiles
    data = init_data(run, tokenizer, docs, source.data_state if source is not None else None)
    schedule, tx, state, train_step = init_training(run, mesh, source, schedule=schedule)
    # The model evaluated, sampled, ranked and exported: Schedule-Free's x, or train.weight_average's average
    # (validation refuses both at once), else the state's own.
    view = eval_view(run.optimizer.hparams) or (weight_average.eval_view(run.train)
                                                if weight_average.NAME in state.metric_states else None)
    return Trainer(run, mesh, tokenizer, data, schedule, tx, state, train_step, make_evaluate(run, data.val, mesh),
                   view, score_tasks)


def check_memory(run: RunConfig, mesh) -> None:
    """Refuse a window that the memory estimate (trainer/memory.py: a lower bound) says cannot fit
    one device: a ConfigError naming dataset.context_length and the largest window that fits. The
    state's shapes come from `eval_shape`: nothing is allocated, read or compiled (once per comparison
    process and step key: the shapes follow from what the step is built from)."""
    def state_bytes() -> int:
        model = models.abstract(run.model, run.train.param_dtype)
        params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))  # eqx.is_array is False for these
        labels = models.param_labels(model)
        opt_state = jax.eval_shape(init_optimizer(run, init_scheduler(run), labels).init, params)
        trained = [x for x, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
                   if label != lora.FROZEN_GROUP]
        return memory.state_bytes(params, opt_state, trained)

    nbytes = shared.remember("state_bytes", shared.view_key(run), state_bytes) if shared.active() else state_bytes()
    capacity, where = memory.device_memory()
    memory.check_window(run, nbytes, mesh.devices.size, capacity, where)


def init_training(run: RunConfig, mesh, source: Source | None = None, metrics=None,
                  schedule: optax.Schedule | None = None):
    """(schedule, optimizer, sharded initial or restored state, train step); model.vocab_size must be resolved.
    `metrics` (StepMetric list) defaults to loss, norms and lrs; `schedule` replaces lr_config's (the LR finder's).

    The optimizer's numeric knobs (lr, schedule, weight decay, betas...: optimizer/arguments.py) are
    the step's arguments, so runs that differ only in them share one compiled program; a replaced
    `schedule` is a constant of the step, and the lr_config's knobs with it."""
    labels = models.param_labels(models.abstract(run.model))
    returned = schedule or init_scheduler(run)  # the run's own (a constant's, past its end too)
    run = dataclasses.replace(run, optimizer=arguments.canonical(run.optimizer))  # constant lr as its trapezoid
    given, view = schedule, shared.step_view(run)  # the view: all the step is built from (and keyed by)

    def recipe(knobs):
        """(tx, metrics) of the run whose optimizer knobs are `knobs` (Python floats or the step's tracers)."""
        o, clip = arguments.bind(view.optimizer, view.train.gradient_clip_val, knobs)
        bound = dataclasses.replace(view, optimizer=o, train=dataclasses.replace(view.train, gradient_clip_val=clip))
        s = given or init_scheduler(bound)
        return init_optimizer(bound, s, labels), (default_metrics(bound, s, labels) if metrics is None else metrics)

    knobs = arguments.lift(run.optimizer, run.train.gradient_clip_val)
    tx, step_metric_list = recipe(knobs)
    # The view is already the canonical run's: its masked repr is view_key(run), without building it again.
    shapes_key = repr(shared.masked(view)) if shared.active() and given is None and metrics is None else None
    state, shardings = init_state(run, tx, mesh, step_metric_list, source, shapes_key)

    def build():
        tau = view.optimizer.qk_clip_tau  # QK-clip: the loss's aux carries the per-head max logits (trainer/qk_clip.py)
        loss = models.train_loss(view.model, view.objective, max_logits=tau is not None)
        return build_train_step(loss, tx, step_metric_list, shardings, mesh, view.train.compute_dtype,
                                use_dropout=models.uses_key(view.model, view.objective), knobs=knobs, recipe=recipe,
                                qk_clip_tau=tau, hessian_due=view.optimizer.hparams.hessian_due)

    if given is not None or metrics is not None:  # a caller's schedule or metrics: no key names them
        return returned, tx, state, build()
    # One traced step per comparison process and key (trainer/process_cache.py); this run's knobs bound to it.
    # The key (the masked view's repr, the shardings flattened) is computed only where a table can use it.
    step = shared.remember("train_step", shared.step_key(view, mesh, shardings), build) if shared.active() else build()
    return returned, tx, state, step.with_args(arguments.as_arguments(knobs))


def default_metrics(run: RunConfig, schedule: optax.Schedule, labels) -> list[step_metrics.StepMetric]:
    """Loss, norms, lrs; with logging.log_callback_data the aux-state hook, per-block norms and the
    optimizer's diagnostics (of the state this update used and left, not the one before it); with
    train.weight_average the average of the weights (trainer/weight_average.py)."""
    o, aux = run.optimizer, run.logging.aux
    by_group = group_schedules(o.hparams, schedule, o.schedule.lr, o.group_overrides, o.hyperball, o.lr_scales)
    metrics = step_metrics.defaults(schedule, by_group, jax.tree.leaves(labels), run.train.skip_nonfinite)
    if aux.on:
        metrics.append(aux_state.AuxHook(aux, labels))
    if aux.on and aux.per_layer:
        metrics += [aux_state.per_layer(models.blocks, run.model.num_blocks), step_metrics.expert_loads()]
    if aux.on and aux.optim_diagnostics:
        metrics.append(step_metrics.optimizer_diagnostics(o.hparams, o.group_overrides, run.train.gradient_clip_val))
    if run.logging.activation_norms:
        metrics.append(ActivationNorms(run.model.num_blocks, run.train.compute_dtype, run.objective.causal))
    average = weight_average.metric(run.train)
    return metrics + ([average] if average else [])


def make_hooks(run: RunConfig, trainer: Trainer, run_dir: str, stop_signals: StopSignals | None,
               source: Source | None = None) -> H.Hooks:
    """The run's periodic jobs, in the order they run after a step."""
    t, ck, data = run.train, run.checkpoint, trainer.data
    flops_per_step = models.flops_per_token(run.model, run.context_length) * data.tokens_per_step
    resumed = source.manifest if source is not None and source.resuming else {}
    hooks: list[H.Hook] = [H.Throughput(run.logging.log_every, data.tokens_per_step, flops_per_step,
                                        peak_flops(t.compute_dtype, run.cache_dir),
                                        resumed.get("metrics", {}).get("time/elapsed_sec", 0.0))]
    if not t.skip_validation:
        hooks.append(H.Evaluation(trainer.evaluate, t.val_freq, t.max_steps, t.val_at_start, t.val_at,
                                  raw=t.weight_average != "none"))  # val/loss_raw beside the average's val/loss
    if trainer.score_tasks:  # eval/<task>/... (eval.tasks)
        hooks.append(tasks.TaskEvaluation(trainer.score_tasks, run.eval.every, t.val_freq, t.max_steps, t.val_at_start,
                                          t.val_at))
    saver = (Checkpointer(ck, run.config_dict, dataclasses.asdict(run.model), warn, trainer.eval_view,
                          frozen_base(trainer, source)) if ck.save else None)
    # Opened last, so a hook that fails to build leaves no open file, bar or wandb run behind.
    sinks = open_sinks(run.logging, run_dir, t.max_steps, int(trainer.state.step), run.config_dict,
                       saved=resumed.get("sinks"))  # a resumed run continues its wandb run
    # the ids and generation_config.json an hf export writes: the base's (model.init_from) or the tokenizer's
    generation = hf_generation.for_run(run.model.init_from, trainer.tokenizer) if saver or ck.export else None
    if saver:
        saver.add_to_manifest("sinks", sinks.state_dict)
        saver.add_to_manifest(hf_generation.MANIFEST_KEY, lambda: generation)
    if t.early_stopping.patience:  # after the evaluation, before the log and the saves
        hooks.append(early_stopping.EarlyStopping(t.early_stopping, resumed.get(early_stopping.MANIFEST_KEY), saver))
    vouchers = (step_metrics.UPDATE_NORM,) if t.skip_nonfinite else H.VOUCHERS  # a skipped step's loss is NaN
    sample = sampler(trainer.tokenizer, jax.random.PRNGKey(run.random_seed), t.sample_temperature, run.context_length,
                     run.objective.generate)  # mdlm: iterative unmasking
    hooks.append(H.Log(sinks))
    if not t.skip_validation and run.logging.sample_prompts:
        hooks.append(H.EvalSamples(sample, run.logging.sample_prompts, run.logging.sample_tokens, sinks))
    hooks.append(H.Divergence(vouchers))
    if saver:
        hooks += [H.Checkpoint(saver, ck.save_path, vouchers, ck.save_at_end, t.max_steps),
                  H.StopOnSignal(stop_signals)]
    if ck.export:  # after the last checkpoint: an export that fails leaves it saved
        hooks.append(RunExport(run, trainer.tokenizer, generation))
    if t.sample_tokens:
        hooks.append(H.Sample(sample, t.sample_prompt, t.sample_tokens))
    return H.Hooks(hooks)


def train_loop(trainer: Trainer, hooks: H.Hooks, ctx: H.LoopContext) -> None:
    """Dispatch step t, run the hooks due at t: the host waits on the device only in a hook that pulls values."""
    batch_sharding, log_every = meshlib.batch_sharding(trainer.mesh, 1), trainer.run.logging.log_every
    hooks.run(ctx)  # the start: the throughput clock, the baseline evaluation
    for step in range(ctx.start + 1, ctx.end + 1):
        if ctx.finished:  # early stopping decided (at the start: a resumed run that had stopped)
            return
        batch = ctx.fetch(lambda: meshlib.put_batch(next(trainer.data.train), batch_sharding))
        logging_step = step % log_every == 0 or step == ctx.end
        ctx.advance(step, *ctx.dispatch(trainer.train_step, batch, logging_step))  # the host moves on
        hooks.run(ctx)
        if ctx.stop:
            hooks.stop(ctx)  # the checkpointer saves
            return


def run_training(run: RunConfig, run_dir: str, source: Source | None = None) -> dict[str, float]:
    """Train from step 0 or `source` to train.max_steps (or checkpoint.num_steps more); the latest value of
    every metric comes back (handy for tests). Raises Preempted after saving on SIGTERM/SIGUSR1/SIGINT."""
    began = H.clock()  # start-up: from here to the loop's start (building, restoring; not the imports)
    trainer = build_trainer(run, source)
    run, ck = trainer.run, run.checkpoint
    start = int(trainer.state.step)
    end = min(run.train.max_steps, start + (ck.num_steps or run.train.max_steps))
    num_params = models.count_params(trainer.state.model)
    announce(run, trainer.state, trainer.mesh, trainer.data, run_dir, num_params, source)
    if start >= run.train.max_steps:
        say(f"nothing to train: the run is at step {start} = train.max_steps")
        return dict(source.manifest.get("metrics", {})) if source else {}
    precompile.compile_ahead(trainer, start, end)  # in a background thread, while the start hooks run
    ctx = H.LoopContext(start, end, trainer.state, trainer.data.train, eval_view=trainer.eval_view)
    # Logged once, with the first record: the data stream's fingerprint and what the source counted, the
    # device the step times were measured on, the parameter count (a comparison's size ladder reads it), and the
    # start-up time (below).
    ctx.add({**diagnostics.state_bytes_metric(trainer.state.opt_state), "data/fingerprint": trainer.data.fingerprint,
             **trainer.data.info, "time/device": jax.devices()[0].device_kind, "model/params": num_params})
    with StopSignals(catch_interrupt=ck.save_on_interrupt) if ck.save else contextlib.nullcontext() as stop_signals:
        hooks = make_hooks(run, trainer, run_dir, stop_signals, source)
        ctx.add({"time/startup_sec": H.clock() - began})
        try:
            train_loop(trainer, hooks, ctx)
        finally:  # inside the handlers: a second SIGTERM cannot kill a save that is still being written
            hooks.close()
            trainer.data.close()
        if ctx.stop:
            raise Preempted(ctx.stop, ctx.step, step_path(ck.save_path, ctx.step))
    return ctx.last


def train(cfg: DictConfig | dict, run_dir: str) -> dict[str, float]:
    """`main` after Hydra (tests call it in-process): pick the checkpoint, settle which config wins, train."""
    config_dict = to_dict(cfg)
    run = validate(config_dict)  # every knob of this command line is checked before any file is touched
    meshlib.init_distributed(run.parallel.distributed)  # before anything asks jax which process this is
    source = resume_source(run.checkpoint, warn)
    if source is not None:
        run = validate(merge_config(source, config_dict, run.checkpoint, warn))
    return run_training(run, run_dir, source)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, float] | float:
    return cli.run_job(cfg, train)  # exit codes 2 (user error) and 3 (preempted); Optuna's objective


if __name__ == "__main__":
    sys.argv[1:] = cli.renamed_argv(sys.argv[1:])  # old optimizer knob names, before Hydra refuses them
    main()
