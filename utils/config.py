"""The config boundary: Hydra's DictConfig in, frozen typed dataclasses out.

Every knob is checked here, before anything compiles, and a bad one raises `ConfigError` with
one line naming it and the fix. Jitted code only ever sees these dataclasses' plain values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.gpt import GPTConfig
from optimizer import OPTIMIZERS
from optimizer.groups import GROUPS, group_hparams, group_knobs
from optimizer.schedules import SCHEDULES, warmup_warning
from utils.checkpoint import CheckpointConfig, user_path
from utils.errors import ConfigError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TokenizerConfig:
    name: str = "byte"  # byte | bpe | hf
    vocab_size: int | None = None  # bpe: size to train
    name_or_path: str | None = None  # hf: hub name or local directory
    sample_docs: int = 2000  # bpe: documents of the train split to train on

    def check(self, prefix: str) -> None:
        if self.name not in ("byte", "bpe", "hf"):
            raise ConfigError(f"{prefix}.name={self.name!r} is unknown: use byte, bpe or hf")
        if self.name == "bpe" and (self.vocab_size is None or self.vocab_size < 258):
            raise ConfigError(f"{prefix}.vocab_size={self.vocab_size} must be >= 258 for a byte-level BPE")
        if self.name == "hf" and not self.name_or_path:
            raise ConfigError(f"{prefix}.name_or_path is empty: set it to a hub name or a local tokenizer directory")
        if self.sample_docs <= 0:
            raise ConfigError(f"{prefix}.sample_docs={self.sample_docs} must be positive")


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "stdlib"  # stdlib | text_files
    batch_size: int = 32  # sequences per micro-batch, global (all devices together)
    total_batch_size: int | None = None  # sequences per optimizer step; null = batch_size
    context_length: int | None = None  # null = model.context_length
    val_fraction: float = 0.05
    include_tests: bool = False  # stdlib: also the test suites (about twice the text)
    paths: tuple[str, ...] = ()  # text_files: globs of .txt/.md/.py/.jsonl files
    text_key: str = "text"  # text_files: field of a .jsonl line holding the text
    shuffle: bool = True

    def check(self, prefix: str) -> None:
        if self.name not in ("stdlib", "text_files"):
            raise ConfigError(f"{prefix}.name={self.name!r} is unknown: use stdlib or text_files")
        if self.batch_size <= 0:
            raise ConfigError(f"{prefix}.batch_size={self.batch_size} must be positive")
        total = self.total_batch_size
        if total is not None and (total <= 0 or total % self.batch_size):
            raise ConfigError(
                f"{prefix}.total_batch_size={total} must be a positive multiple of "
                f"{prefix}.batch_size={self.batch_size} (gradient accumulation = total / batch)"
            )
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError(f"{prefix}.context_length={self.context_length} must be positive or null")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"{prefix}.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.name == "text_files" and not self.paths:
            raise ConfigError(f"{prefix}.paths is empty: give globs of text files, e.g. dataset.paths='[data/*.txt]'")

    @property
    def accum_steps(self) -> int:
        return (self.total_batch_size or self.batch_size) // self.batch_size


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 500
    gradient_clip_val: float | None = 1.0  # global-norm clip; null or 0 turns it off
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # bfloat16 for GPUs; no faster on CPU
    val_freq: int = 100
    max_val_steps: int = 20
    skip_validation: bool = False
    val_at_start: bool = True
    sample_tokens: int = 200  # tokens generated at the end (0: none)
    sample_prompt: str = "def "
    sample_temperature: float = 0.8

    def check(self, prefix: str) -> None:
        for knob in ("max_steps", "val_freq", "max_val_steps"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be a positive integer")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise ConfigError(f"{prefix}.gradient_clip_val={self.gradient_clip_val} must be >= 0 or null")
        for knob in ("param_dtype", "compute_dtype"):
            if getattr(self, knob) not in DTYPES:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)!r} must be one of {', '.join(DTYPES)}")
        if self.sample_tokens < 0:
            raise ConfigError(f"{prefix}.sample_tokens={self.sample_tokens} must be >= 0")
        if self.sample_temperature < 0:
            raise ConfigError(f"{prefix}.sample_temperature={self.sample_temperature} must be >= 0 (0 = greedy)")


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 10
    progress_bar: bool = True  # a tqdm bar on a terminal; plain lines otherwise
    metrics_file: str = "metrics.jsonl"
    wandb: bool = False
    wandb_project: str = "eqtrain"
    wandb_mode: str = "online"  # online | offline | disabled

    def check(self, prefix: str) -> None:
        if self.log_every <= 0:
            raise ConfigError(f"{prefix}.log_every={self.log_every} must be a positive integer")
        if self.wandb_mode not in ("online", "offline", "disabled"):
            raise ConfigError(f"{prefix}.wandb_mode={self.wandb_mode!r} must be online, offline or disabled")


@dataclass(frozen=True)
class ParallelConfig:
    data: int = -1  # devices on the data axis; -1 = all devices not used by fsdp
    fsdp: int = 1  # devices over which parameters and optimizer state are sharded

    def check(self, prefix: str) -> None:
        if self.data == 0 or self.data < -1:
            raise ConfigError(f"{prefix}.data={self.data} must be positive or -1 (all remaining devices)")
        if self.fsdp <= 0:
            raise ConfigError(f"{prefix}.fsdp={self.fsdp} must be a positive integer")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str
    hparams: Any  # the registered dataclass, e.g. optimizer.adamw.AdamW
    schedule_name: str
    schedule: Any  # e.g. optimizer.schedules.Cosine
    schedule_steps: int  # lr_config.max_steps, or train.max_steps when null
    group_overrides: dict  # {"hidden": {"lr": 0.02}, ...}: only the knobs set (non-null)


@dataclass(frozen=True)
class RunConfig:
    model: GPTConfig
    tokenizer: TokenizerConfig
    dataset: DatasetConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    logging: LoggingConfig
    parallel: ParallelConfig
    random_seed: int
    cache_dir: str  # trained tokenizers, tokenized corpora, the measured CPU peak
    checkpoint: CheckpointConfig = CheckpointConfig()
    warnings: tuple[str, ...] = ()  # legal but probably unintended settings, printed at start

    @property
    def context_length(self) -> int:
        return self.dataset.context_length or self.model.context_length


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, knob: str) -> Any:
    """Check one value against its annotation, converting only where YAML is ambiguous
    (an int where a float is expected, an integral float where an int is)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], knob)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{knob}={value!r} must be a list")
        return tuple(_coerce(v, args[0], f"{knob}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{knob}={value!r} must be {'null or ' if value is None else ''}a {_type_name(tp)}")


def build_section(cls: type, node: dict, prefix: str):
    """One config section -> `cls`, rejecting unknown knobs and calling `cls.check(prefix)`."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix} must be a mapping of knobs, got {node!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(node) - set(fields))
    if unknown:
        raise ConfigError(f"unknown knob {prefix}.{unknown[0]}: known knobs are {', '.join(sorted(fields))}")
    kwargs = {}
    for name, field in fields.items():
        if name in node:
            kwargs[name] = _coerce(node[name], hints[name], f"{prefix}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}.{name} is missing: set it in the yaml or on the command line")
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check(prefix)
    return obj


def _pop_name(node: dict, prefix: str, registry: dict) -> str:
    name = node.pop("name", None)
    if name not in registry:
        raise ConfigError(f"{prefix}.name={name!r} is unknown: choose one of {', '.join(sorted(registry))}")
    return name


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
                hint = getattr(hparams, "group_knob_hint", None)
                fix = (hint(group, knob) if hint else None) or (
                    f"the {group} group does not use it; it takes {', '.join(knobs)}")
                raise ConfigError(f"{prefix}.{knob}: {fix}")
            value = _coerce(value, fields.get(knob, float), f"{prefix}.{knob}")
            if knob == "lr" and value <= 0:
                raise ConfigError(f"{prefix}.lr={value} must be positive")
            out.setdefault(group, {})[knob] = value
        group_hparams(hparams, group, out).check(prefix)
    return out


def to_dict(cfg: DictConfig | dict) -> dict:
    """The composed config as plain, resolved Python containers (hydra's own node dropped)."""
    if isinstance(cfg, dict):
        return {k: v for k, v in cfg.items() if k != "hydra"}
    try:
        raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {str(e).splitlines()[0]}") from None
    return {k: v for k, v in raw.items() if k != "hydra"}


def validate(cfg: DictConfig | dict) -> RunConfig:
    """The whole composed config -> RunConfig, or a ConfigError naming the first bad knob."""
    raw = to_dict(cfg)

    expected = {"model", "tokenizer", "dataset", "optimizer", "train", "logging", "parallel", "random_seed",
                "cache_dir"}
    unknown = sorted(set(raw) - expected - {"checkpoint"})
    if unknown:
        raise ConfigError(f"unknown top-level config key {unknown[0]!r}: known keys are "
                          f"{', '.join(sorted(expected | {'checkpoint'}))}")
    missing = sorted(expected - set(raw))
    if missing:
        raise ConfigError(f"config lacks the {missing[0]!r} section: is conf/config.yaml's defaults list intact?")

    train = build_section(TrainConfig, raw["train"], "train")
    opt_node = dict(raw["optimizer"])
    lr_node = dict(opt_node.pop("lr_config", None) or {})
    groups_node = opt_node.pop("groups", None) or {}
    opt_name = _pop_name(opt_node, "optimizer", OPTIMIZERS)
    schedule_name = _pop_name(lr_node, "optimizer.lr_config", SCHEDULES)
    schedule = build_section(SCHEDULES[schedule_name], lr_node, "optimizer.lr_config")
    schedule_steps = getattr(schedule, "max_steps", None) or train.max_steps
    if hasattr(schedule, "check_steps"):
        schedule.check_steps("optimizer.lr_config", schedule_steps)
    if hasattr(schedule, "warning"):
        warning = schedule.warning("optimizer.lr_config", schedule_steps)
    else:
        warning = warmup_warning("optimizer.lr_config", getattr(schedule, "warmup", 0), schedule_steps)
    hparams = build_section(OPTIMIZERS[opt_name], opt_node, "optimizer")
    optimizer = OptimizerConfig(
        name=opt_name,
        hparams=hparams,
        group_overrides=_group_overrides(groups_node, hparams),
        schedule_name=schedule_name,
        schedule=schedule,
        schedule_steps=schedule_steps,
    )
    seed = raw["random_seed"]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"random_seed={seed!r} must be a non-negative integer")

    run = RunConfig(
        model=build_section(GPTConfig, raw["model"], "model"),
        tokenizer=build_section(TokenizerConfig, raw["tokenizer"], "tokenizer"),
        dataset=build_section(DatasetConfig, raw["dataset"], "dataset"),
        optimizer=optimizer,
        train=train,
        logging=build_section(LoggingConfig, raw["logging"], "logging"),
        parallel=build_section(ParallelConfig, raw["parallel"], "parallel"),
        random_seed=seed,
        cache_dir=user_path(str(raw["cache_dir"])),
        checkpoint=build_section(CheckpointConfig, raw.get("checkpoint") or {}, "checkpoint").resolved(),
        warnings=(warning,) if warning else (),
    )
    ck = run.checkpoint
    if ck.keep_best and run.train.skip_validation:
        raise ConfigError("checkpoint.keep_best=true ranks checkpoints by val/loss: set train.skip_validation=false "
                          "or checkpoint.keep_best=false")
    beyond = [s for s in ck.save_at or () if s > train.max_steps]
    if ck.save and beyond:
        run = dataclasses.replace(run, warnings=run.warnings + (
            f"checkpoint.save_steps {beyond} lie beyond train.max_steps={train.max_steps} and will not be saved",))
    m = run.model
    if m.tie_embeddings and "head" in run.optimizer.group_overrides:
        knob = next(iter(run.optimizer.group_overrides["head"]))
        raise ConfigError(f"optimizer.groups.head.{knob} is set but model.tie_embeddings=true: there is no separate "
                          "head (the embedding matrix is reused; tune optimizer.groups.embed instead) or set "
                          "model.tie_embeddings=false")
    if m.attn_block_size is not None and (m.attn_block_size >= run.context_length
                                          or run.context_length % m.attn_block_size):
        raise ConfigError(f"model.attn_block_size={m.attn_block_size} must divide the training context "
                          f"({run.context_length} tokens) into 2 or more blocks, e.g. {run.context_length // 2}; "
                          "null turns block-causal attention off")
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
