"""Golden values: the exact losses of the tiny GPT's first steps on a fixed batch, per optimizer.

A refactor must leave every number here unchanged. If a test fails, find out why before touching
the table: update GOLDEN only for an intended numerical change (a new default, a fixed bug in an
update rule), and say which in the commit message. Regenerate with

    python tests/test_golden.py        # prints the table for the current code
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_jax as T  # noqa: E402
from conftest import compose_config  # noqa: E402
from optimizer import OPTIMIZERS  # noqa: E402
from utils import mesh as meshlib  # noqa: E402
from utils.config import validate  # noqa: E402

STEPS = 3
# (loss logged at step 1, 2, 3; loss of the weights after step 3), float32 on CPU.
GOLDEN = {
    "adafactor": [4.182358741760254, 4.0236287117004395, 3.925274133682251, 3.8762333393096924],
    "adamw": [4.182358741760254, 4.023641109466553, 3.9217748641967773, 3.8448293209075928],
    "lion": [4.182358741760254, 4.16099214553833, 4.139874458312988, 4.119263648986816],
    "muon": [4.182358741760254, 4.035089015960693, 3.9272773265838623, 3.8371713161468506],
    "sgdm": [4.182358741760254, 4.072270393371582, 3.971487283706665, 3.78739333152771],
    "shampoo": [4.182358741760254, 4.016491413116455, 3.8931398391723633, 3.7910454273223877],
}
# XLA's CPU kernels may reassociate sums differently across CPU generations; a real numerical
# change (an lr, a default, an update rule) moves these losses by far more.
RTOL = 2e-5


def golden_losses(optimizer: str) -> list[float]:
    """The tiny test GPT (dim 32, 2 blocks, context 16, vocab 64), batch 8, dropout 0, the
    optimizer's defaults with a constant lr after 1 warmup-free step, 3 updates on one fixed batch."""
    run = validate(compose_config(f"optimizer={optimizer}", "optimizer/lr_config=constant",
                                  "optimizer.lr_config.warmup=0", f"train.max_steps={STEPS}"))
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch_1xBxT1 = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch = meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    _, metrics = step(state, batch)  # its logged loss is that of the weights after step 3
    return losses + [float(metrics["train/loss"])]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_golden_losses(optimizer):
    assert optimizer in GOLDEN, f"no golden values for {optimizer}: run `python tests/test_golden.py` and add them"
    got = golden_losses(optimizer)
    np.testing.assert_allclose(
        got, GOLDEN[optimizer], rtol=RTOL,
        err_msg=f"{optimizer}: the first losses of the tiny GPT changed. Update GOLDEN only for an intended "
                "numerical change, and say so in the commit message.")


def test_golden_losses_fall():
    """The table itself describes learning: every optimizer lowers the loss on the batch it steps on."""
    for name, (first, *_, after) in GOLDEN.items():
        assert after < first, name


if __name__ == "__main__":
    for name in sorted(OPTIMIZERS):
        values = ", ".join(repr(v) for v in golden_losses(name))
        print(f'    "{name}": [{values}],')
