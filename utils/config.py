"""The config boundary: Hydra's DictConfig in, frozen typed dataclasses out.

Every knob is checked here, before anything compiles, and a bad one raises `ConfigError` with
one line naming it and the fix. Jitted code only ever sees these dataclasses' plain values.

This is the one module of utils/ that imports upward (models, optimizer, loaders): it composes
their config classes, each of which lives beside what it configures and checks its own knobs;
what is left here are the rules that span sections.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import models
from loaders import dataset_config, tokenizer_config
from loaders.config import DatasetConfig
from models import attention, contract
from models import mup as mup_model
from models.hf import resolve_init_from
from models.objectives import AR, OBJECTIVES, check_vocab
from optimizer import OPTIMIZERS, for_run
from optimizer import cautious as cautious_mask
from optimizer import hyperball as hyperball_lib
from optimizer import mup as mup_optim
from optimizer.groups import GROUPS, group_hparams, group_knobs
from optimizer.renames import FILLS, message, rename_config, resolve
from optimizer.schedules import SCHEDULES, warmup_warning
from trainer import run_export
from trainer.early_stopping import EarlyStoppingConfig
from trainer.loss_scale import LossScaleConfig
from trainer.tasks import EvalConfig
from utils.checkpoint.storage import CheckpointConfig
from utils.errors import ConfigError
from utils.files import user_path
from utils.logging.sinks import LoggingConfig, logging_config
from utils.parallel.mesh import ParallelConfig
from utils.sections import _coerce, build_registered, build_section

DTYPES = ("float32", "bfloat16")  # of the weights and optimizer state
COMPUTE_DTYPES = DTYPES + ("float16",)  # float16 with dynamic loss scaling (trainer/loss_scale.py)
WEIGHT_AVERAGES = ("none", "ema", "tail")  # train.weight_average (trainer/weight_average.py)


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 500
    gradient_clip_val: float | None = 1.0  # global-norm clip; null or 0 turns it off
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # bfloat16 (or float16, loss-scaled) for GPUs; no faster on CPU
    val_freq: int = 100
    val_at: tuple[int, ...] = ()  # also evaluate at these steps (increasing, <= max_steps)
    max_val_steps: int = 20
    skip_validation: bool = False
    val_at_start: bool = True
    sample_tokens: int = 200  # tokens generated at the end (0: none)
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    skip_nonfinite: bool = False  # a step with a non-finite gradient is skipped instead of stopping the run
    max_consecutive_skips: int = 10  # after this many in a row the update is applied and the run stops
    weight_average: str = "none"  # none | ema | tail: the weights evaluated and exported (trainer/weight_average.py)
    weight_average_half_life: float = 100.0  # ema: steps for a step's weight in the average to halve
    weight_average_tail: float = 0.2  # tail: the last fraction of train.max_steps averaged uniformly
    # built from the train.early_stopping mapping in validate (a nested section)
    early_stopping: EarlyStoppingConfig = dataclasses.field(default_factory=EarlyStoppingConfig)
    # built from the train.loss_scale mapping in validate; read under compute_dtype=float16 only
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)

    def check(self, prefix: str) -> None:
        for knob in ("max_steps", "val_freq", "max_val_steps"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be a positive integer")
        at = list(self.val_at)
        if any(s <= 0 for s in at) or any(b <= a for a, b in zip(at, at[1:])):
            raise ConfigError(f"{prefix}.val_at={at} must list positive steps in increasing order without repeats, "
                              f"e.g. {prefix}.val_at={sorted({s for s in at if s > 0})}")
        if at and at[-1] > self.max_steps:
            raise ConfigError(f"{prefix}.val_at={at} lists steps beyond {prefix}.max_steps={self.max_steps}: "
                              f"drop them or raise {prefix}.max_steps")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise ConfigError(f"{prefix}.gradient_clip_val={self.gradient_clip_val} must be >= 0 or null")
        if self.param_dtype == "float16":  # no float32 master copy: loss scaling could not help
            raise ConfigError(f"{prefix}.param_dtype='float16' is refused: float16 weights round small updates "
                              f"away and Adam's second moment underflows; keep float32 and set "
                              f"{prefix}.compute_dtype=float16")
        for knob, allowed in (("param_dtype", DTYPES), ("compute_dtype", COMPUTE_DTYPES)):
            if getattr(self, knob) not in allowed:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)!r} must be one of {', '.join(allowed)}")
        if self.compute_dtype == "float16" and self.param_dtype != "float32":
            raise ConfigError(f"{prefix}.compute_dtype=float16 needs {prefix}.param_dtype=float32 (the master weights "
                              f"its loss scaling unscales into); with {self.param_dtype} weights use "
                              f"{prefix}.compute_dtype=bfloat16, which needs no loss scale")
        if self.max_consecutive_skips <= 0:
            raise ConfigError(f"{prefix}.max_consecutive_skips={self.max_consecutive_skips} must be a positive integer")
        if self.sample_tokens < 0:
            raise ConfigError(f"{prefix}.sample_tokens={self.sample_tokens} must be >= 0")
        if self.sample_temperature < 0:
            raise ConfigError(f"{prefix}.sample_temperature={self.sample_temperature} must be >= 0 (0 = greedy)")
        if self.weight_average not in WEIGHT_AVERAGES:
            raise ConfigError(f"{prefix}.weight_average={self.weight_average!r} must be one of "
                              f"{', '.join(WEIGHT_AVERAGES)}")
        if not self.weight_average_half_life > 0:
            raise ConfigError(f"{prefix}.weight_average_half_life={self.weight_average_half_life} must be > 0 "
                              f"(optimizer steps), e.g. {prefix}.weight_average_half_life=100")
        if not 0 < self.weight_average_tail <= 1:
            raise ConfigError(f"{prefix}.weight_average_tail={self.weight_average_tail} must lie in (0, 1] (the "
                              f"fraction of {prefix}.max_steps averaged), e.g. {prefix}.weight_average_tail=0.2")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str
    hparams: Any  # the registered dataclass, e.g. optimizer.adamw.AdamW
    schedule_name: str
    schedule: Any  # e.g. optimizer.schedules.Cosine
    schedule_steps: int  # lr_config.max_steps, or train.max_steps when null
    group_overrides: dict  # {"hidden": {"lr": 0.02}, ...}: only the knobs set (non-null)
    cautious: bool = False  # optimizer.cautious, beside `name`: every optimizer takes it (optimizer/cautious.py)
    hyperball: bool = False  # optimizer.hyperball, beside `name`: every optimizer takes it (optimizer/hyperball.py)
    qk_clip_tau: float | None = None  # optimizer.qk_clip_tau, beside `name`: QK-clip (trainer/qk_clip.py)
    lr_scales: dict = dataclasses.field(default_factory=dict)  # {group: lr factor}: model.mup's (optimizer/mup.py)


@dataclass(frozen=True)
class RunConfig:
    model: Any  # the model family's Config (models.MODELS by model.name)
    tokenizer: Any  # a registered tokenizer config, e.g. loaders.tokenizers.bpe.BPE
    dataset: DatasetConfig  # batch-shape knobs + `source`, a registered source config
    optimizer: OptimizerConfig
    train: TrainConfig
    logging: LoggingConfig
    parallel: ParallelConfig
    random_seed: int
    data_seed: int  # data order; the yaml's null resolves to random_seed
    cache_dir: str  # trained tokenizers, tokenized corpora, the measured CPU peak
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()  # downstream tasks scored during training (trainer/tasks.py)
    objective: Any = AR()  # models.objectives: ar | mdlm (the loss, attention's causality, evaluation, sampling)
    warnings: tuple[str, ...] = ()  # legal but probably unintended settings, printed at start
    notes: tuple[str, ...] = ()  # choices made for this machine (model.attention=auto's), printed in the header
    compile_cache: bool = True  # XLA's persistent compilation cache in cache_dir (utils/compile_cache.py)
    config_dict: dict | None = None  # the plain config this was validated from: saved with checkpoints, sent to wandb

    @property
    def context_length(self) -> int:
        return self.dataset.context_length or self.model.context_length


def _group_overrides(node: dict, hparams) -> dict[str, dict[str, float]]:
    """`optimizer.groups.<group>.<knob>` -> {group: {knob: value}} with nulls dropped; every
    group's resulting hyperparameters are checked like the optimizer's own.

    A knob no group takes is refused even when null (a typo in a yaml); a knob that only other
    groups take is refused once set (the group would ignore it), with the optimizer's
    `group_knob_hint(group, knob)` as the fix where it has one."""

    if not isinstance(node, dict):
        raise ConfigError(f"optimizer.groups must be a mapping of group -> knobs, got {node!r}")
    fields = typing.get_type_hints(type(hparams))
    anywhere = {knob for group in GROUPS for knob in group_knobs(hparams, group)}
    out: dict[str, dict[str, float]] = {}
    for group, settings in node.items():
        prefix = f"optimizer.groups.{group}"
        if group not in GROUPS:
            raise ConfigError(f"{prefix}: unknown parameter group; groups are {', '.join(GROUPS)}")
        knobs = group_knobs(hparams, group)
        for knob, value in (settings or {}).items():
            if knob not in anywhere:
                raise ConfigError(f"{prefix}.{knob} cannot be set per group; this optimizer allows {', '.join(knobs)}")
            if value is None:
                continue
            if knob not in knobs:
                fix = hparams.group_knob_hint(group, knob) or (
                    f"the {group} group does not use it; it takes {', '.join(knobs)}")
                raise ConfigError(f"{prefix}.{knob}: {fix}")
            value = _coerce(value, fields.get(knob, float), f"{prefix}.{knob}")
            if knob == "lr" and value <= 0:
                raise ConfigError(f"{prefix}.lr={value} must be positive")
            out.setdefault(group, {})[knob] = value
        group_hparams(hparams, group, out).check(prefix)
    return out


def _eval_config(node: dict) -> EvalConfig:
    """The eval section, its task files resolved as the user typed them (read when the run starts)."""
    e = build_section(EvalConfig, node, "eval")
    return dataclasses.replace(e, tasks=tuple(user_path(p) for p in e.tasks))


def to_dict(cfg: DictConfig | dict) -> dict:
    """The composed config as plain, resolved Python containers (hydra's own node dropped)."""
    if isinstance(cfg, dict):
        return {k: v for k, v in cfg.items() if k != "hydra"}
    try:
        raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {str(e).splitlines()[0]}") from None
    return {k: v for k, v in raw.items() if k != "hydra"}


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


# `[+|++|~]optimizer.<knob>[=...]` and `optimizer.groups.<group>.<knob>[=...]`: the overrides a rename touches.
_KNOB_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<stem>optimizer\.(?:groups\.(?P<group>\w+)\.)?)"
                            r"(?P<knob>[A-Za-z_]\w*)(?P<rest>=.*)?$", re.S)
_OPTIMIZER_CHOICE = re.compile(r"^(?:\+\+|\+)?optimizer=", re.S)


def default_optimizer() -> str:
    """The optimizer conf/config.yaml's defaults list picks when no `optimizer=` override does."""
    node = OmegaConf.load(os.path.join(CONF_DIR, "config.yaml"))
    return next((str(entry["optimizer"]) for entry in node.get("defaults", [])
                 if isinstance(entry, DictConfig) and "optimizer" in entry), "adamw")


def chosen_optimizers(overrides: list[str]) -> list[str] | None:
    """The optimizers a command line runs: its last `optimizer=` override's (every one of a sweep
    `optimizer=a,b` or `choice(a,b)`), else the default; None when Hydra's parser cannot list them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    chosen = [o for o in overrides if _OPTIMIZER_CHOICE.match(o)]
    if not chosen:
        return [default_optimizer()]
    try:
        override = OverridesParser.create().parse_override(chosen[-1])
        if override.is_sweep_override():
            return [str(v) for v in override.sweep_string_iterator()]
        return [str(override.get_value_element_as_str())]
    except HydraException:  # a glob or another sweep whose values need the config: leave the overrides to Hydra
        return None


_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    """A rename's warning, once per process (a comparison composes the same overrides for every run)."""
    if line not in _WARNED:
        _WARNED.add(line)
        from utils.logging.messages import warn

        warn(line)


def renamed_overrides(overrides: list[str], warn: Callable[[str], None] | None = None) -> list[str]:
    """Command-line overrides with the old optimizer knob names (optimizer/renames.py) renamed for the
    optimizers they reach, one `warn` line each (default: printed once per process), before Hydra,
    which refuses a key the yaml lacks, sees them. An old and a new name of one knob both given, or
    an old name a sweep's optimizers read differently: a ConfigError."""
    overrides = list(overrides)
    if not any(_KNOB_OVERRIDE.match(o) for o in overrides):
        return overrides
    optimizers = chosen_optimizers(overrides)
    if optimizers is None:
        return overrides
    warn = warn or _warn_once
    out, typed = [], {}
    for override in overrides:
        m = _KNOB_OVERRIDE.match(override)
        if m:
            key = m["stem"] + m["knob"]
            renamed = resolve(optimizers, m["knob"], key, m["group"])
            new_key = m["stem"] + next(iter(renamed.values())) if renamed else key
            if renamed:
                warn(message(",".join(renamed), key, new_key))
                override = f"{m['prefix'] or ''}{new_key}{m['rest'] or ''}"
            typed.setdefault(new_key, set()).add(key)
        out.append(override)
    for key, names in typed.items():
        if len(names) > 1:
            old = sorted(names - {key})[0]
            raise ConfigError(f"{old} (an old name) and {key} both set {key}: keep only {key}")
    for opt in optimizers:  # a knob split off a shared one: an old command line that set the shared one changed
        for new, shared in FILLS.get(opt, {}).items():
            if f"optimizer.{shared}" in typed and f"optimizer.{new}" not in typed:
                warn(f"optimizer={opt}: `optimizer.{shared}` no longer also sets what `optimizer.{new}` sets now "
                     f"(see conf/optimizer/{opt}.yaml); set `optimizer.{new}` too to keep the old behaviour")
    return out


def split_overrides(overrides: list[str]) -> tuple[tuple[str, ...], list] | None:
    """(the overrides that select a config group, Hydra's parsed overrides of the other keys: values), or
    None when one is neither plainly (a deletion, a package, a sweep, a hydra key): compose those whole.
    A key selects a group where conf/ has a folder of that name, as Hydra decides (its repository's
    group_exists) for this project's only config source."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups, values = [], []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        hydra_key = key.split("/")[0].split(".")[0] == "hydra"
        if o.package is not None or o.is_delete() or o.is_sweep_override() or hydra_key:
            return None
        if os.path.isdir(os.path.join(CONF_DIR, *key.split("/"))):
            groups.append(o.input_line)
        else:
            values.append(o)
    return tuple(groups), values


def compose_reusing(overrides: list[str], job_name: str) -> DictConfig:
    """compose_overrides(overrides), with conf/ composed once per selection of its groups in a comparison
    process (trainer/process_cache.py's `sharing()`) and each run's value overrides applied to a copy as
    Hydra applies them (its own function, after the defaults list, which only the groups decide).

    Why: Hydra's composition (~0.4 s on the 2-core VM) reads and merges every yaml of the defaults list
    again for each of a comparison's hundreds of runs, which differ in a few values; tests/test_compose_reuse.py
    checks the result equals a real compose for every run of a comparison's plan. Outside `sharing()`,
    or for an override that is neither a group selection nor a value, it is compose_overrides."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from trainer import process_cache

    if not process_cache.active():
        return compose_overrides(overrides, job_name)
    overrides = renamed_overrides(overrides)
    try:
        split = split_overrides(overrides)
        if split is None:
            return compose_overrides(overrides, job_name)
        groups, values = split
        base = process_cache.remember("composed", (groups, job_name), lambda: compose_overrides(list(groups), job_name))
        cfg = copy.deepcopy(base)  # the table's config stays as composed
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg
    except Exception:  # noqa: BLE001 - a bad override: Hydra's own composition raises its one-line error
        return compose_overrides(overrides, job_name)


def compose_overrides(overrides: list[str], job_name: str) -> DictConfig:
    """conf/ composed with command-line overrides outside `@hydra.main` (the scripts), Hydra's
    composition errors turned into one ConfigError line (an unknown group option lists the choices).
    Old optimizer knob names are renamed first (`renamed_overrides`)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = renamed_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name=job_name):
            return compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        options = []
        if len(lines) > 1 and lines[1].startswith("Available options"):  # an unknown group option
            for line in lines[2:]:
                if line.endswith(":"):  # "Config search path:" follows the options
                    break
                options.append(line)
        raise ConfigError(lines[0] + (f": choose one of {', '.join(options)}" if options else "")) from None


def validate(cfg: DictConfig | dict) -> RunConfig:
    """The whole composed config -> RunConfig, or a ConfigError naming the first bad knob. A config
    dict with old optimizer knob names (a checkpoint's from before a rename) is renamed, each rename
    one of the run's warnings."""
    renames: list[str] = []
    raw = rename_config(to_dict(cfg), renames.append)

    expected = {"model", "tokenizer", "dataset", "optimizer", "train", "logging", "parallel", "random_seed",
                "data_seed", "cache_dir"}
    optional = {"checkpoint", "objective", "compile_cache", "eval"}  # configs saved before a key have none: its default
    unknown = sorted(set(raw) - expected - optional)
    if unknown:
        raise ConfigError(f"unknown top-level config key {unknown[0]!r}: known keys are "
                          f"{', '.join(sorted(expected | optional))}")
    missing = sorted(expected - set(raw))
    if missing:
        raise ConfigError(f"config lacks the {missing[0]!r} section: is conf/config.yaml's defaults list intact?")

    train_node = dict(raw["train"])
    stopping = build_section(EarlyStoppingConfig, train_node.pop("early_stopping", None) or {}, "train.early_stopping")
    scaling = build_section(LossScaleConfig, train_node.pop("loss_scale", None) or {}, "train.loss_scale")
    train = dataclasses.replace(build_section(TrainConfig, train_node, "train"), early_stopping=stopping,
                                loss_scale=scaling)
    if train.compute_dtype == "float16":  # an overflow is loss scaling's signal to back off, not a divergence
        train = dataclasses.replace(train, skip_nonfinite=True)
    if stopping.patience and train.skip_validation:
        raise ConfigError("train.early_stopping.patience watches val/loss, but train.skip_validation=true: "
                          "set one of them off")
    opt_node = dict(raw["optimizer"])
    lr_node = dict(opt_node.pop("lr_config", None) or {})
    groups_node = opt_node.pop("groups", None) or {}
    cautious = _coerce(opt_node.pop("cautious", False), bool, "optimizer.cautious")  # absent in old checkpoints
    hyperball = _coerce(opt_node.pop("hyperball", False), bool, "optimizer.hyperball")  # absent in old checkpoints
    qk_clip_tau = _coerce(opt_node.pop("qk_clip_tau", None), float | None, "optimizer.qk_clip_tau")  # ditto
    if qk_clip_tau is not None and not 0 < qk_clip_tau < float("inf"):
        raise ConfigError(f"optimizer.qk_clip_tau={qk_clip_tau} must be a positive attention logit (Kimi K2: 100), "
                          "or null to turn QK-clip off")
    schedule_name, schedule = build_registered(SCHEDULES, lr_node, "optimizer.lr_config")
    schedule_steps = getattr(schedule, "max_steps", None) or train.max_steps
    if hasattr(schedule, "check_steps"):
        schedule.check_steps("optimizer.lr_config", schedule_steps)
    if hasattr(schedule, "warning"):
        warning = schedule.warning("optimizer.lr_config", schedule_steps)
    else:
        warning = warmup_warning("optimizer.lr_config", getattr(schedule, "warmup", 0), schedule_steps)
    opt_name, hparams = build_registered(OPTIMIZERS, opt_node, "optimizer")
    hparams = for_run(hparams, schedule_name, schedule, train.max_steps)  # knobs that depend on the run
    if cautious:
        cautious_mask.check(hparams, opt_name)
    if train.weight_average != "none" and getattr(hparams, "eval_params", None) is not None:
        raise ConfigError(f"train.weight_average={train.weight_average} cannot be combined with optimizer={opt_name}, "
                          "which evaluates its own average of the weights: set train.weight_average=none or choose "
                          "another optimizer")
    group_overrides = _group_overrides(groups_node, hparams)
    if hyperball:
        hyperball_lib.check(hparams, opt_name, group_overrides)
    optimizer = OptimizerConfig(
        name=opt_name,
        hparams=hparams,
        group_overrides=group_overrides,
        schedule_name=schedule_name,
        schedule=schedule,
        schedule_steps=schedule_steps,
        cautious=cautious,
        hyperball=hyperball,
        qk_clip_tau=qk_clip_tau,
    )
    seed = raw["random_seed"]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"random_seed={seed!r} must be a non-negative integer")
    data_seed = seed if raw["data_seed"] is None else raw["data_seed"]
    if not isinstance(data_seed, int) or isinstance(data_seed, bool) or data_seed < 0:
        raise ConfigError(f"data_seed={data_seed!r} must be a non-negative integer, or null to follow random_seed")

    run = RunConfig(
        model=models.config_from_dict(raw["model"], "model"),
        tokenizer=tokenizer_config(raw["tokenizer"], "tokenizer"),
        dataset=dataset_config(raw["dataset"], "dataset"),
        optimizer=optimizer,
        train=train,
        logging=logging_config(raw["logging"], "logging"),
        parallel=build_section(ParallelConfig, raw["parallel"], "parallel"),
        random_seed=seed,
        data_seed=data_seed,
        cache_dir=user_path(str(raw["cache_dir"])),
        compile_cache=_coerce(raw.get("compile_cache", True), bool, "compile_cache"),
        checkpoint=build_section(CheckpointConfig, raw.get("checkpoint") or {}, "checkpoint").resolved(),
        eval=_eval_config(raw.get("eval") or {}),
        objective=build_registered(OBJECTIVES, raw.get("objective") or {"name": "ar"}, "objective")[1],
        warnings=tuple(renames) + ((warning,) if warning else ()),
        config_dict=raw,
    )
    if run.model.init_from:  # a Hugging Face directory's shapes (weights at build) and tokenizer: models/hf.py
        model, notes, tok_dir = resolve_init_from(run.model)
        tokenizer = tokenizer_config({"name": "hf", "name_or_path": tok_dir}, "tokenizer") if tok_dir else run.tokenizer
        notes += (f"tokenizer={raw['tokenizer'].get('name')} replaced by the tokenizer of model.init_from "
                  f"(tokenizer=hf)",) if tok_dir and tokenizer != run.tokenizer else ()
        # The saved config says what ran: an export, a resume and the data's tokenizer check read it.
        raw = {**raw, "tokenizer": {"name": "hf", "name_or_path": tok_dir}} if tok_dir else raw
        dataset, window = run.dataset, ()
        if dataset.context_length is None:  # the yaml's window, not the directory's maximum (131072 for some)
            dataset = dataclasses.replace(dataset, context_length=min(run.model.context_length, model.context_length))
            window = (f"window: {dataset.context_length} tokens (dataset.context_length=null trains on the model "
                      f"yaml's model.context_length; {model.context_length}, model.init_from's maximum, stays the "
                      f"model's limit: set dataset.context_length to train on more)",)
        run = dataclasses.replace(run, model=model, tokenizer=tokenizer, dataset=dataset, warnings=run.warnings + notes,
                                  notes=run.notes + window, config_dict=raw)
    if run.eval.tasks and not run.objective.causal:
        raise ConfigError(f"eval.tasks scores continuations left to right, but objective={run.objective.name} "
                          "attends both ways: set eval.tasks=[] or objective=ar")
    ck = run.checkpoint
    run_export.check(run)  # checkpoint.export and its knobs
    if ck.keep_best and run.train.skip_validation:
        raise ConfigError("checkpoint.keep_best=true ranks checkpoints by val/loss: set train.skip_validation=false "
                          "or checkpoint.keep_best=false")
    beyond = [s for s in ck.save_at or () if s > train.max_steps]
    if ck.save and beyond:
        run = dataclasses.replace(run, warnings=run.warnings + (
            f"checkpoint.save_steps {beyond} lie beyond train.max_steps={train.max_steps} and will not be saved",))
    m = run.model
    if mup_model.on(m):  # the optimizer's half of muP, and the header's line saying which rule applies
        scales, line, is_warning = mup_optim.lr_scales(hparams, opt_name, mup_model.width_ratio(m), m.dim,
                                                       m.mup_base_dim, hyperball)
        run = dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, lr_scales=scales),
                                  warnings=run.warnings + (line,) * is_warning,
                                  notes=run.notes + (line,) * (not is_warning))
    if hyperball and m.lora.on:
        raise ConfigError(f"optimizer.hyperball=true with model.lora.rank={m.lora.rank}: only the LoRA "
                          "factors train (B starts at norm 0, no sphere to keep); set optimizer.hyperball=false")
    if qk_clip_tau is not None:
        check_qk_clip(m, qk_clip_tau)
    if m.tie_embeddings and "head" in run.optimizer.group_overrides:
        knob = next(iter(run.optimizer.group_overrides["head"]))
        raise ConfigError(f"optimizer.groups.head.{knob} is set but model.tie_embeddings=true: there is no separate "
                          "head (the embedding matrix is reused; tune optimizer.groups.embed instead) or set "
                          "model.tie_embeddings=false")
    if m.attn_block_size is not None and not run.objective.causal:
        raise ConfigError(f"model.attn_block_size={m.attn_block_size} skips the causal mask's upper triangle, but "
                          f"objective={run.objective.name} attends both ways: set model.attn_block_size=null")
    if m.attn_block_size is not None and (m.attn_block_size >= run.context_length
                                          or run.context_length % m.attn_block_size):
        raise ConfigError(f"model.attn_block_size={m.attn_block_size} must divide the training context "
                          f"({run.context_length} tokens) into 2 or more blocks, e.g. {run.context_length // 2}; "
                          "null turns block-causal attention off")
    attention.check_run(m, run.train.compute_dtype, run.context_length, run.dataset.document_mask)
    kv_heads = getattr(m, "kv_heads", None)  # grouped-query families: each tensor shard holds whole kv heads
    if kv_heads is not None and kv_heads % run.parallel.tensor:
        raise ConfigError(f"parallel.tensor={run.parallel.tensor} must divide the model's {kv_heads} key/value heads "
                          "(model.num_kv_heads): pick a parallel.tensor that divides it")
    experts = m.moe.num_experts  # models/moe.py: whole experts per device
    if run.parallel.expert > 1 and (not experts or experts % run.parallel.expert):
        raise ConfigError(f"parallel.expert={run.parallel.expert} must divide model.moe.num_experts={experts} (each "
                          "device holds whole experts): pick a divisor, or parallel.expert=1")
    if run.train.param_dtype == "bfloat16":
        run = dataclasses.replace(run, warnings=run.warnings + (
            "train.param_dtype=bfloat16 stores the weights and the optimizer state in bfloat16 with no float32 "
            "master copy: small updates round away; keep float32 and set train.compute_dtype=bfloat16 for speed",))
    if run.context_length > run.model.context_length:
        raise ConfigError(
            f"dataset.context_length={run.dataset.context_length} exceeds model.context_length="
            f"{run.model.context_length}: lower it or set it to null"
        )
    return run


def check_qk_clip(m, tau: float) -> None:
    """optimizer.qk_clip_tau with a model whose q and k it cannot rescale, or whose max logits it cannot read."""
    knob = f"optimizer.qk_clip_tau={tau}"
    if contract.optional(models.family(m), "scale_query_key") is None:
        raise ConfigError(f"{knob}: model.name={m.name} does not say where its query and key weights are "
                          "(no scale_query_key): set optimizer.qk_clip_tau=null")
    if m.lora.on:
        raise ConfigError(f"{knob} with model.lora.rank={m.lora.rank}: the query and key weights are the frozen base "
                          "(the factors add a term the clip cannot scale alone); set optimizer.qk_clip_tau=null")
    if getattr(m, "qk_norm", False):
        raise ConfigError(f"{knob} with model.qk_norm=true: the norm undoes any scale of W_q and W_k, so the clip "
                          "cannot bound the logits (QK-norm bounds them already); set optimizer.qk_clip_tau=null")
    if m.attention == "cudnn":
        raise ConfigError(attention.QK_CLIP_CUDNN)


def resolve_vocab(run: RunConfig, vocab_size: int) -> RunConfig:
    """The model config finished once the tokenizer and JAX's backend are up: model.attention's
    kernel for this machine (models/attention.py; the header says which and why), and model.vocab_size
    null -> the tokenizer's `vocab_size`, padded to model.vocab_multiple, with room for the ids the
    objective adds (mdlm: the mask id, the vocabulary's last)."""
    m, note = attention.resolve(run.model, run.train.compute_dtype, run.context_length, run.dataset.document_mask)
    if run.optimizer.qk_clip_tau is not None and m.attention == "cudnn":  # auto's pick: an explicit one is refused
        m, note = dataclasses.replace(m, attention="xla"), ("attention: xla (auto: optimizer.qk_clip_tau reads each "
                                                            "head's max logit, which cuDNN's fused kernel never forms)")
    run = dataclasses.replace(run, model=m, notes=run.notes + (note,) * all(not n.startswith("attention:")
                                                                              for n in run.notes))
    if m.vocab_size is None:
        padded = -(-(vocab_size + run.objective.extra_ids) // m.vocab_multiple) * m.vocab_multiple
        return dataclasses.replace(run, model=dataclasses.replace(m, vocab_size=padded))
    if m.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {vocab_size} "
                          "ids: raise it or set it to null")
    check_vocab(run.objective, m.vocab_size, vocab_size)
    return run
