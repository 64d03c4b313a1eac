"""Golden values: the exact losses of the tiny GPT's first steps on a fixed batch, per optimizer.

A refactor must leave every number here unchanged. If a test fails, find out why before touching
the table: update GOLDEN only for an intended numerical change (a new default, a fixed bug in an
update rule), and say which in the commit message. Regenerate with

    python tests/test_golden.py                 # prints the table for the current code
    python tests/test_golden.py --write NAME    # adds or rewrites one optimizer's row in tests/data/golden_losses.json
                                                # and its diagnostics' names in tests/data/golden_diagnostics.json

A new optimizer gets its row with `--write <its name>` (then check that its losses fall, which the
test also asserts); the others' rows change only for an intended numerical change.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import compose_config, per_optimizer

import train_jax as T
from optimizer import OPTIMIZERS
from utils.config import validate
from utils.parallel import mesh as meshlib

STEPS = 3
# (loss logged at step 1, 2, 3; loss of the weights after step 3), float32 on CPU.
GOLDEN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_losses.json")
with open(GOLDEN_FILE, encoding="utf-8") as _f:
    GOLDEN: dict[str, list[float]] = json.load(_f)
# Relative tolerances from float32 error (EPS32 = 2⁻²³ ≈ 1.19e-7), since XLA's kernels on another
# CPU reassociate sums differently. Each loss is a mean over 128 tokens of a log-softmax after a
# 2-block forward whose dot products have <= 128 terms: ≲ √128 ≈ 11 EPS32 of rounding, and the
# first-order updates carry relative errors through 3 steps without amplifying them (a random
# 1-EPS32 relative change of every initial weight moves these losses by <= 1 EPS32). 2e-5 (~170
# EPS32) leaves > 10× room; an lr 0.1% off moves the last losses by 2-4e-5, a real change far more.
RTOL = 2e-5
# Shampoo's losses after updates 2 and 3 are ill-conditioned: update 1 computes the roots of
# S + 1e-6·λmax·I, damped null-space eigenvalues, and steps 2-3 reuse them (precondition_every=10)
# on gradients that reach that null space, where an eigh error of δ·λmax changes the root by
# δ/(4·1e-6): one rounding (δ = EPS32) is already 3%. Measured condition: the 1-EPS32 weight
# change above moves these two losses by ~30 and ~90 EPS32 (AdamW's: <= 1), and a kernel that
# rounds differently perturbs the statistics and eigh by ~√K roundings (K = 32..128 terms, ≈ 6-11),
# not one: up to ~1e-4 (≈ 840 EPS32). The losses before (steps 1-2, from one root applied in
# its range space) keep RTOL. (The table was 1.2e-5 = 62% of the former 2e-5 off on other CPUs.)
SHAMPOO_RTOL = [RTOL, RTOL, 1e-4, 1e-4]
# SOAP's likewise: its bases are the eigenvectors of update 1's statistics (held to update 11), and
# Adam's per-entry division in that basis amplifies their rounding. Measured the same way: the
# 1-EPS32 weight change moves the losses after updates 2 and 3 by ~1-7 and ~15-70 EPS32 (~200 and
# ~1300 before SOAP fixed its bases in the statistics' null spaces, see optimizer/soap.py), so
# Shampoo's ~840 EPS32 holds. (SOAP's update 1 is zero on the matrices: the loss after it moves
# only by the scalars' Adam step and the decay, at RTOL.)
GOLDEN_RTOL = {"shampoo": SHAMPOO_RTOL, "soap": SHAMPOO_RTOL}
# Updates that move nothing by design: ADOPT's first only sets its second moment (v = g², no decay
# at its default weight_decay 0), so its first two losses are the same number.
STILL_UPDATES = {"adopt": 1}
# Prodigy's learned step starts at d0 = 1e-6: its 3 updates from there move the last loss by 9e-5,
# 2e-5 of it (the table's tolerance), and a step half as large would pass; from 1e-3, by 2%.
GOLDEN_EXTRA = {"prodigy": ("optimizer.d0=1e-3",)}


def golden_run(optimizer: str, data: int = 1, fsdp: int = 1, devices=None) -> tuple[list[float], object]:
    """(losses, final state) of the tiny test GPT (dim 32, 2 blocks, context 16, vocab 64), batch 8,
    dropout 0, each optimizer's defaults (SGD-M's and Lion's lr and GOLDEN_EXTRA aside) under a cosine
    schedule with 5 warmup steps, 3 updates on
    one fixed batch, on a data x fsdp mesh (default: one device; tests/sharded_step_check.py runs it
    on 8). The run config is test_groups.py's (the same compiled step: the compilation cache serves both)."""
    lr = {"sgdm": 0.3, "lion": 3e-3}.get(optimizer)
    run = validate(compose_config(f"optimizer={optimizer}", "train.max_steps=30", "optimizer.lr_config.warmup=5",
                                  *([f"optimizer.lr_config.lr={lr}"] if lr else []), *GOLDEN_EXTRA.get(optimizer, ())))
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


@pytest.mark.parametrize("optimizer", per_optimizer(sorted(OPTIMIZERS)))
def test_golden_losses(optimizer):
    """The computed losses match the table and fall: each optimizer learns the batch it steps on
    (the table alone could hold losses that rise), after the updates that move nothing by design."""
    assert optimizer in GOLDEN, (f"no golden values for {optimizer}: run `python tests/test_golden.py --write "
                                 f"{optimizer}` (tests/data/golden_losses.json)")
    got = golden_losses(optimizer)
    rtol = np.asarray(GOLDEN_RTOL.get(optimizer, RTOL))
    np.testing.assert_array_less(  # |got - golden| <= rtol·|golden|, rtol per step
        np.abs(np.subtract(got, GOLDEN[optimizer])), rtol * np.abs(GOLDEN[optimizer]),
        err_msg=f"{optimizer}: the first losses of the tiny GPT changed. Update GOLDEN only for an intended "
                "numerical change, and say so in the commit message.")
    still = STILL_UPDATES.get(optimizer, 0)
    assert got[:still + 1] == [got[0]] * (still + 1), (optimizer, got)
    assert all(a > b for a, b in zip(got[still:], got[still + 1:])), (optimizer, got)


if __name__ == "__main__":
    names = sys.argv[2:] if sys.argv[1:2] == ["--write"] else []
    if names:
        from test_optim_diagnostics import NAMES, NAMES_FILE, diagnostic_names

        for path, table in ((GOLDEN_FILE, {**GOLDEN, **{name: golden_losses(name) for name in names}}),
                            (NAMES_FILE, {**NAMES, **{name: diagnostic_names(name) for name in names}})):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(table, f, indent=1, sort_keys=True)
                f.write("\n")
            print(f"wrote {', '.join(names)} into {path}")
    else:
        for name in sorted(OPTIMIZERS):
            values = ", ".join(repr(v) for v in golden_losses(name))
            print(f'    "{name}": [{values}],')
