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


@background.setup
def orthogonal_check(ctx) -> ShardedCheck:
    return ShardedCheck(ctx.tmp_path_factory.mktemp("orthogonal"), ctx.tmp_path_factory.mktemp("orthogonal_cache"),
                        args=("--orthogonal",))


@pytest.fixture(scope="module")
def result(orthogonal_check) -> dict:
    return orthogonal_check.result()


@pytest.mark.slow  # ~9 sharded compiles in a subprocess
@pytest.mark.parametrize("name", ORTHOGONAL)
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_sharded_orthogonalising_step_equals_the_unsharded_one(result, name, mesh):
    r = result[name]
    sharded = r[mesh]
    assert result["devices"] == 8 and sharded["mesh"] == MESHES[mesh]
    # every block matrix is split, and so is its optimizer state (momentum, Dion's buffer)
    assert sharded["sharded_param_leaves"] >= 4 and sharded["hidden_state_split"] >= 4
    assert "fsdp" in sharded["specs"]["mlp_in"] and ("tensor" in sharded["specs"]["mlp_in"]) == (mesh != "fsdp8")
    assert sharded["kept"]
    np.testing.assert_allclose(sharded["losses"], r["losses_1"], rtol=LOSS_RTOL)
    assert r["losses_1"][-1] < r["losses_1"][0]
    # The weights: each leaf within PARAM_ATOL_FACTOR of the steps' size (see below).
    for diff, scale in zip(sharded["diffs"], sharded["scales"], strict=True):
        assert diff <= PARAM_ATOL + 3 * EPS32 * scale, (name, mesh, diff, scale)
    assert r["params_moved"] > 100 * PARAM_ATOL  # the comparison is not between two untouched inits


PARAM_ATOL = 0.0  # set from the derivation below
