"""Host memory of a run's start from a Hugging Face directory (`model.init_from`): resident memory
before, at the peak of, and after the model is built (and after it is freed again).

    python bench/import_memory.py                          # a ~125M-parameter bfloat16 llama directory
    python bench/import_memory.py --dim 256 --blocks 4     # smaller
    python bench/import_memory.py --param-dtype float32

Writes a random llama directory in bfloat16 (config.json + model.safetensors, as a downloaded
checkpoint is) to a scratch directory, then in a fresh Python process: imports jax and eqtrain,
records RSS (psutil), builds the model the way a run's init does (`jax.jit(models.build)` with
`model.init_from`, `train.param_dtype` as given), records the peak (VmHWM) and the RSS with
the model alive, frees it (`del`, `gc.collect()`) and records the RSS left. On the CPU backend the
model's arrays are host memory too, so "model alive" includes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import gc, json, sys
import psutil
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {root!r})
import dataclasses, models
from models import hf
mb = lambda b: b / 2**20
# VmHWM: this process's peak RSS since exec (ru_maxrss would carry the parent's over exec)
hwm = lambda: next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
proc = psutil.Process()
jax.jit(lambda: jnp.zeros(1))().block_until_ready()  # the backend up, outside the measurement
cfg, _ = hf.config_from_dir({path!r}, models.config_from_dict({{"name": "llama", "dim": 8, "num_heads": 2,
                                                             "num_blocks": 1, "context_length": 8}}))
cfg = dataclasses.replace(cfg, init_from={path!r})
before = proc.memory_info().rss
model = jax.jit(lambda: models.build(cfg, jax.random.PRNGKey(0), {dtype!r}))()
jax.block_until_ready(model)
alive = proc.memory_info().rss
peak = hwm()
model_bytes = sum(x.nbytes for x in jax.tree.leaves(model))
del model
gc.collect()
after = proc.memory_info().rss
print(json.dumps(dict(before_mb=mb(before), peak_mb=mb(peak), alive_mb=mb(alive), freed_mb=mb(after),
                      model_mb=mb(model_bytes))))
"""


def write_dir(path: str, dim: int, blocks: int, vocab: int) -> int:
    """A random bfloat16 llama directory; returns the safetensors file's bytes."""
    import jax
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    import models
    from models import hf

    cfg = models.config_from_dict({"name": "llama", "dim": dim, "num_heads": dim // 64, "num_blocks": blocks,
                                   "context_length": 2048, "vocab_size": vocab, "tie_embeddings": False})
    model = models.build(cfg, jax.random.PRNGKey(0), "bfloat16")
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(ml_dtypes.bfloat16))
               for k, v in models.family(model).hf_tensors(model).items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, hf.WEIGHTS_FILE), metadata={"format": "pt"})
    config = {**hf.hf_dir_config(model), "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
        json.dump(config, f)
    return os.path.getsize(os.path.join(path, hf.WEIGHTS_FILE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = write_dir(tmp, args.dim, args.blocks, args.vocab)
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, path=tmp, dtype=args.param_dtype)],
                             check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ckpt = size / 2**20
    print(f"checkpoint {ckpt:.0f} MB (bfloat16), model {r['model_mb']:.0f} MB in {args.param_dtype}")
    print(f"RSS before {r['before_mb']:.0f} MB, peak {r['peak_mb']:.0f} MB (+{r['peak_mb'] - r['before_mb']:.0f}), "
          f"model alive {r['alive_mb']:.0f} MB, after it is freed {r['freed_mb']:.0f} MB "
          f"(+{r['freed_mb'] - r['before_mb']:.0f} left)")
    bound = 1.5 * ckpt + r["model_mb"]
    print(f"peak over before: {r['peak_mb'] - r['before_mb']:.0f} MB; bound 1.5 x checkpoint + model = {bound:.0f} MB")


if __name__ == "__main__":
    main()
