"""Export a checkpoint's model as OUT_DIR/model.safetensors + OUT_DIR/config.json.

    python scripts/export_model.py ckpt/run1 --out exported/
    python scripts/export_model.py ckpt/run1 --load-file iter_2000 --out exported/ --force

Only the model is read (never the optimizer state): the one the run evaluates, so a
Schedule-Free run's averaged weights (the checkpoint's `eval_model`), not the point it trained.
Tensors are named by their pytree path (`blocks.attn_qkv.weight_IxO`); config.json holds the
model config plus `step`, the run's `tokenizer` section and its `objective`. `models.export.load_export(OUT_DIR)`
rebuilds the model from the two files.
"""

from __future__ import annotations

import os
import sys

# Run as `python scripts/export_model.py`, Python puts scripts/ on sys.path, not the repo root;
# the editable install would find the packages, but only those of the checkout it was made from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

from models import export, objectives
from utils.checkpoint import inference
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
                   help="write into a non-empty OUT_DIR, replacing model.safetensors and config.json there")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_jax_probe()
    try:
        inference.check_out_dir(args.out, args.force)
        source, run, model = inference.restore_for_inference(args.checkpoint_dir, args.load_file)
        export.save_export(args.out, model, source.step, source.config.get("tokenizer", {}), run.context_length,
                           objectives.as_dict(run.objective))
    except (EqtrainError, OSError) as e:
        return script_error(e, where=args.out, hint="check --out")
    print(f"exported {source.path} (step {source.step}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
