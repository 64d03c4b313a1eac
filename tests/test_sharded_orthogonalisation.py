"""Muon, NorMuon and Dion under FSDP and tensor parallelism: their updates orthogonalise whole
hidden matrices (Newton–Schulz; Dion's QR of A·Q), so a matrix split over devices must give the
update its unsplit self gives. tests/sharded_step_check.py --orthogonal runs each for 3 steps of 2
micro-batches on 1 device, on fsdp 8 and on tensor 2 x fsdp 4 (8 forced host devices, a
subprocess: the device count is fixed before jax is imported), every hidden matrix and its
optimizer state split; XLA's partitioner gathers what the whole-matrix operations need."""

from __future__ import annotations

import math

import background
import numpy as np
import pytest
from helpers import EPS32, ShardedCheck

ORTHOGONAL = ("muon", "normuon", "dion")
MESHES = {"fsdp8": {"data": 1, "fsdp": 8, "tensor": 1}, "tensor2_fsdp4": {"data": 1, "fsdp": 4, "tensor": 2}}
# The losses, as tests/test_train_step.py's SHARDED_RTOL: a mean over 256 tokens, ~√256·EPS32 of its
# scale per mesh, two meshes, 2x margin.
LOSS_RTOL = 4 * math.sqrt(256) * EPS32
# The weights after 3 steps (Muon, NorMuon). A gradient entry sums 2·8·16 = 256 tokens' terms, so two
# meshes differ by ~√256·EPS32 of its scale (sharded_step_check.py's derivation); the Newton–Schulz
# input X/‖X‖ with it. Each quintic iteration p(x) = ax + bx³ + cx⁵ passes a perturbation of a
# singular value on times |p'(x)| <= 4 on [0, 1.2] (p'(0) = a = 3.44, p'(1.2) = 3.9), so 5 iterations
# by <= 4⁵ = 1024; NorMuon's per-neuron rescaling is scale-invariant and passes relative errors on.
# An orthogonalised update's entries are <= 1, times lr = 1e-2 and the shape factor <= √(128/32) = 2;
# 3 steps add up; 2x margin.
LR, STEPS, NS_SLOPE = 1e-2, 3, 4.0**5
PARAM_ATOL = 2 * STEPS * LR * 2 * NS_SLOPE * math.sqrt(256) * EPS32


@background.setup
def orthogonal_check(ctx) -> ShardedCheck:
    return ShardedCheck(ctx.tmp_path_factory.mktemp("orthogonal"), ctx.tmp_path_factory.mktemp("orthogonal_cache"),
                        args=("--orthogonal",))


@pytest.fixture(scope="module")
def result(orthogonal_check) -> dict:
    return orthogonal_check.result()


@pytest.mark.slow  # 9 sharded and unsharded compiles in a subprocess (~5 min on the 2-core VM)
@pytest.mark.parametrize("name", ORTHOGONAL)
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_sharded_orthogonalising_step_equals_the_unsharded_one(result, name, mesh):
    """The losses of the 3 steps within LOSS_RTOL of one device's, every block matrix and its
    optimizer state split; Muon's and NorMuon's weights within PARAM_ATOL. Dion's weights are not
    compared: its QR input A·Q starts from a random Q, and a QR's output moves by up to κ₂(A·Q)
    times its input's error, with no bound on κ₂ to derive a tolerance from (tests/test_parity_dion.py
    measures it per block; 10²-10⁴ on the first step); its losses, functions of all its weights, are."""
    r = result[name]
    sharded = r[mesh]
    assert result["devices"] == 8 and sharded["mesh"] == MESHES[mesh]
    # the 4 block matrices are split, and so is the optimizer state shaped like them
    assert sharded["sharded_param_leaves"] >= 4 and sharded["hidden_state_split"] >= 4
    assert "fsdp" in sharded["specs"]["mlp_in"] and ("tensor" in sharded["specs"]["mlp_in"]) == (mesh != "fsdp8")
    assert sharded["kept"]
    np.testing.assert_allclose(sharded["losses"], r["losses_1"], rtol=LOSS_RTOL)
    assert r["losses_1"][-1] < r["losses_1"][0]
    if name != "dion":
        # and each weight rounds once per step on each side: STEPS·EPS32 of its scale
        for diff, scale in zip(sharded["diffs"], sharded["scales"], strict=True):
            assert diff <= PARAM_ATOL + STEPS * EPS32 * scale, (name, mesh, diff, scale)
    assert r["params_moved"] > 10 * PARAM_ATOL  # the comparison is not between two untouched inits
