"""Export a checkpoint's model as OUT_DIR/model.safetensors + OUT_DIR/config.json.

    python scripts/export_model.py ckpt/run1 --out exported/
    python scripts/export_model.py ckpt/run1 --load-file iter_2000 --out exported/ --force
    python scripts/export_model.py ckpt/run1 --format hf --out hf_model/
    python scripts/export_model.py ckpt/lora1 --merge-lora --out merged/

Only the model is read (never the optimizer state): the one the run evaluates, so a
Schedule-Free run's averaged weights (the checkpoint's `eval_model`), not the point it trained.
Tensors are named by their pytree path (`blocks.attn_qkv.weight_IxO`); config.json holds the
model config plus `step`, the run's `tokenizer` section and its `objective`. `models.export.load_export(OUT_DIR)`
rebuilds the model from the two files.

`--format hf` writes a Hugging Face transformers directory instead (models/hf.py): config.json
(model_type gpt2, llama, qwen2, qwen3; an MoE llama as mixtral, qwen2_moe, qwen3_moe or olmoe), the weights
(in --dtype, below) with Hugging Face's tensor names and layouts, and the tokenizer's files for a
BPE or Hugging Face tokenizer (the byte tokenizer has none);
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it offline. masked-diffusion (mdlm) models are
refused.

`--dtype float32|bfloat16|float16` casts every float tensor (round to nearest even); config.json's
`dtype`/`torch_dtype` say it, so `from_pretrained` loads them as they are. Default: the dtype of the
Hugging Face base a run started from (`model.init_from`, as its checkpoint recorded it), else the
run's train.param_dtype. `--max-shard-size 5GB` (transformers' notation: 500MB, 5GiB, or bytes)
splits larger `--format hf` weights as transformers' save_pretrained does: model-00001-of-0000N.safetensors
+ model.safetensors.index.json. Every export is written to a scratch directory beside OUT_DIR and
renamed into place: a failed export leaves OUT_DIR as it was.

A LoRA run (model.lora.rank > 0): `--merge-lora` writes the merged weights W + (alpha/rank)·A·B as a
plain model (rank 0 in config.json), in either format. `--format peft` writes the factors alone as a
PEFT adapter directory (models/hf_peft.py: adapter_config.json with r, lora_alpha, target_modules;
adapter_model.safetensors with PEFT's names) for the run's `model.init_from` base:
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT_DIR)`. Without
--merge-lora or --format peft, the safetensors export holds the base and the factors (and the `lora`
config) and `load_export` rebuilds the LoRA model; `--format hf` needs --merge-lora (a transformers
model has no place for the factors).

A run writes the same export itself at its last step with checkpoint.export=safetensors|hf|peft and
checkpoint.export_dtype / export_max_shard_size / export_merge_lora for these flags (trainer/run_export.py,
the same writer: trainer.inference.write_export; docs/checkpoints.md), on several processes too.
"""

from __future__ import annotations

import os
import sys

# Run as `python scripts/export_model.py`, Python puts scripts/ on sys.path, not the repo root;
# the editable install would find the packages, but only those of the checkout it was made from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

import models
from models import hf_generation
from trainer import export_options, inference
from utils.cli import quiet_jax_probe
from utils.errors import EqtrainError
from utils.files import user_path
from utils.script_errors import script_error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = inference.checkpoint_parser(__doc__)
    p.add_argument("--out", required=True, metavar="OUT_DIR", type=user_path,
                   help="directory to write model.safetensors and config.json into; created if missing, "
                        "must be empty unless --force")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT_DIR, replacing the files this export writes (and a previous "
                        "export's weights in the other layout: model.safetensors or shards); other files stay")
    p.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="safetensors: eqtrain's export (models/export.py; default); hf: a transformers directory "
                        "(config.json, model.safetensors with Hugging Face names, the tokenizer's files) that "
                        "AutoModelForCausalLM.from_pretrained(OUT_DIR) loads; peft: a LoRA run's factors as a PEFT "
                        "adapter (adapter_config.json, adapter_model.safetensors) that "
                        "peft.PeftModel.from_pretrained(base, OUT_DIR) loads onto its model.init_from base")
    p.add_argument("--dtype", metavar="DTYPE",
                   help="float32, bfloat16 or float16: the dtype of every exported float tensor (config.json says it). "
                        "Default: the model.init_from base's dtype for a run started from one, else train.param_dtype")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="--format hf: split weights larger than SIZE (5GB, 500MB, 5GiB, or bytes; transformers' "
                        "notation) into model-0000i-of-0000N.safetensors + model.safetensors.index.json, as "
                        "save_pretrained does; default: one model.safetensors")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run's checkpoint: write the merged weights W + (alpha/rank)·A·B, a plain model of the "
                        "base's shape (needed for --format hf); without it the safetensors export keeps the factors")
    return p.parse_args(argv)


def check_flags(args: argparse.Namespace) -> int | None:
    """The flags alone, before any checkpoint is opened: one-line ConfigErrors (the checks a run's
    checkpoint.export knobs get, trainer/export_options.py). Returns the shard size in bytes."""
    return export_options.check(args.format, args.dtype, args.max_shard_size, export_options.FLAGS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_jax_probe()
    try:
        shard_size = check_flags(args)
        inference.check_out_dir(args.out, args.force)
        source, run, model = inference.restore_for_inference(args.checkpoint_dir, args.load_file)
        model = models.for_export(model, args.merge_lora, args.format)  # LoRA: merged, or refused for hf
        saved = source.manifest.get(hf_generation.MANIFEST_KEY)  # bos/eos/pad, generation_config.json, base dtype
        generation = hf_generation.checked(saved, f"{source.path} manifest") if saved is not None else None
        dtype, why = inference.export_dtype(args.dtype, run, generation)
        print(f"dtype: {dtype} ({why})")
        # the writer a run's own export (checkpoint.export) uses too
        wrote = inference.write_export(args.out, args.format, run, model, source.step,
                                       source.config.get("tokenizer", {}), generation, dtype, shard_size)
        if wrote is not None:
            print(wrote)
    except (EqtrainError, OSError) as e:
        return script_error(e, where=args.out, hint="check --out")
    print(f"exported {source.path} (step {source.step}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
