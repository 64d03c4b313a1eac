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
    "adafactor": [4.182358741760254, 4.14007043838501, 4.061954021453857, 3.966634511947632],
    "adamw": [4.182358741760254, 4.140071868896484, 4.066746234893799, 3.9891908168792725],
    "lion": [4.182358741760254, 4.140074729919434, 4.064736843109131, 3.9754083156585693],
    "muon": [4.182358741760254, 4.14584493637085, 4.0797319412231445, 4.004652976989746],
    "sgdm": [4.182358741760254, 4.13124418258667, 4.054842472076416, 3.9591245651245117],
    "shampoo": [4.182358741760254, 4.138559341430664, 4.025544166564941, 3.898228406906128],
}
# XLA's CPU kernels may reassociate sums differently across CPU generations; a real numerical
# change (an lr, a default, an update rule) moves these losses by far more.
RTOL = 2e-5


def golden_run(optimizer: str, data: int = 1, fsdp: int = 1, devices=None) -> tuple[list[float], object]:
    """(losses, final state) of the tiny test GPT (dim 32, 2 blocks, context 16, vocab 64), batch 8,
    dropout 0, each optimizer's defaults under a cosine schedule with 5 warmup steps, 3 updates on
    one fixed batch, on a data x fsdp mesh (default: one device; tests/sharded_step_check.py runs it
    on 8). The run config is test_groups.py's (the same compiled step: the compilation cache serves both)."""
    lr = {"sgdm": 0.3, "lion": 3e-3}.get(optimizer)
    run = validate(compose_config(f"optimizer={optimizer}", "train.max_steps=30", "optimizer.lr_config.warmup=5",
                                  *([f"optimizer.lr_config.lr={lr}"] if lr else [])))
    mesh = meshlib.make_mesh(data, fsdp, run.dataset.batch_size, devices=devices or jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch_1xBxT1 = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch = meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))
    losses = []
    for _ in range(STEPS + 1):  # the last logged loss is that of the weights after step 3
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    return losses, state


def golden_losses(optimizer: str) -> list[float]:
    return golden_run(optimizer)[0]


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
