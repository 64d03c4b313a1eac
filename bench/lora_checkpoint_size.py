"""What one LoRA checkpoint weighs: the base saved by reference (model.init_from) against saved whole.

    python bench/lora_checkpoint_size.py                       # gpt_bench's shape, rank 16
    python bench/lora_checkpoint_size.py model=gpt_tiny model.lora.rank=4

Writes a random model of the chosen shape as a Hugging Face directory in a scratch directory,
trains 2 steps of LoRA from it (`model.init_from`: checkpoints hold the factors, the base by
reference: utils/checkpoint/frozen.py) and 2 steps from a random base of the same shape (saved
whole), with the default logging (the aux-state hook on), and prints the bytes of each item of
the two checkpoints. Arguments are Hydra overrides of conf/config.yaml.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from hydra import compose, initialize_config_dir

import models
import train_jax
from models import hf
from utils.config import validate

DEFAULTS = ("model=gpt_bench", "model.lora.rank=16", "model.lora.alpha=32")
RUN = ("train.max_steps=2", "dataset.batch_size=2", "train.skip_validation=true", "train.sample_tokens=0",
       "checkpoint.save=true", "compile_cache=false")


def compose_run(overrides):
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def item_bytes(path: str) -> dict[str, int]:
    out = {}
    for item in sorted(os.listdir(path)):
        full = os.path.join(path, item)
        if os.path.isdir(full):
            out[item] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(full) for f in fs)
    return out


def main(argv: list[str]) -> int:
    overrides = [*DEFAULTS, *argv]
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        base_cfg = validate(compose_run([*overrides, "model.lora.rank=0"])).model
        base_cfg = models.config_from_dict({**models.as_dict(base_cfg), "vocab_size": base_cfg.vocab_size or 512})
        hf.save_hf("pretrained", models.build(base_cfg, jax.random.PRNGKey(0)))
        sizes = {}
        for name, source in (("init_from", "model.init_from=pretrained"), ("random base", "model.init_from=null")):
            os.makedirs(f"run_{len(sizes)}")
            ck = f"ck_{len(sizes)}"
            train_jax.train(compose_run([*overrides, *RUN, source, f"checkpoint.save_path={ck}"]),
                            os.path.abspath(f"run_{len(sizes)}"))
            sizes[name] = item_bytes(os.path.join(ck, "iter_2"))
    items = sorted({item for s in sizes.values() for item in s})
    print(f"\n{'item':<16}" + "".join(f"{name:>16}" for name in sizes))
    for item in [*items, "whole"]:
        row = [s.get(item, 0) if item != "whole" else sum(s.values()) for s in sizes.values()]
        print(f"{item:<16}" + "".join(f"{b / 1e6:>13.1f} MB" for b in row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
