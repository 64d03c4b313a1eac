"""A LoRA run's factors as a PEFT adapter directory (`export --format peft`), which
`peft.PeftModel.from_pretrained(base, OUT_DIR)` loads onto the transformers model of the base
(the run's `model.init_from` directory, named in the config as base_model_name_or_path):

    adapter_config.json         PEFT's LoraConfig: peft_type LORA, task_type CAUSAL_LM, r = model.lora.rank,
                                lora_alpha = model.lora.alpha, lora_dropout, target_modules (the Hugging
                                Face module paths of the targeted projections, e.g. self_attn.q_proj or
                                attn.c_attn: PEFT matches a module whose name ends with one),
                                fan_in_fan_out (GPT-2's Conv1D), use_rslora false
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight (rank, in) and .lora_B.weight
                                (out, rank), the family's `hf_lora_tensors`

The conventions agree: PEFT adds scaling·lora_B(lora_A(dropout(x))) with scaling = lora_alpha / r
(use_rslora false), ours adds (alpha/rank)·dropout(x)·A·B (models/lora.py), so lora_A = Aᵀ and
lora_B = Bᵀ with no factor moved between them.
"""

from __future__ import annotations

import json
import os

import equinox as eqx

import models
from models import hf, hf_shards
from models.contract import optional
from utils import files
from utils.errors import CheckpointError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix before the transformers model's own names


def adapter_config(model: eqx.Module, base: str | None) -> dict:
    """adapter_config.json of a LoRA model (PEFT fills the keys left out with its defaults)."""
    lora = model.cfg.lora
    modules = sorted({_module(name) for name in models.family(model).hf_lora_tensors(model)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
            "fan_in_fan_out": optional(models.family(model), "HF_LORA_FAN_IN_FAN_OUT"), "bias": "none",
            "use_rslora": False,
            "use_dora": False, "lora_bias": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}}


def _module(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.lora_A.weight` -> `self_attn.q_proj`: the path inside a block,
    which names that projection in every block (PEFT matches module names ending in `.` + it)."""
    parts = name.split(".")
    block = next(i for i, p in enumerate(parts) if p.isdigit())
    return ".".join(parts[block + 1:-2])


def save_peft(out_dir: str, model: eqx.Module, base: str | None, dtype: str = "float32") -> list[str]:
    """Write OUT_DIR as a PEFT adapter of `model`'s factors in `dtype` (utils.files.atomic_dir: all or
    nothing); `base` is the base directory recorded for PeftModel. Returns the file names."""
    from safetensors.numpy import save_file

    family = models.family(model)
    if optional(family, "hf_lora_tensors") is None:
        raise CheckpointError(f"--format peft: the {model.cfg.name} family has no PEFT names for its factors: "
                              "use --merge-lora --format hf")
    hf.refuse_moe(model.cfg, "MoE blocks cannot be exported as a PEFT adapter")
    config = adapter_config(model, base)
    tensors = hf.as_dtype({PREFIX + k: v for k, v in family.hf_lora_tensors(model).items()}, dtype)
    if not tensors:
        raise CheckpointError("--format peft: this checkpoint holds no LoRA factors (model.lora.rank=0): use "
                              "--format hf")
    with files.atomic_dir(out_dir, replaces=hf_shards.is_weights_file) as scratch:
        save_file(tensors, os.path.join(scratch, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(scratch, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [WEIGHTS_FILE, CONFIG_FILE]
