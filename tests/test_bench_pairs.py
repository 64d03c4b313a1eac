"""bench/step_speed.py --pairs: the alternation and median logic of bench/pairs.py with stand-in
steps on a fake clock (no timing is asserted: the clock is ours), the one-line install hint when
torch is missing, and, in the parity tier, that bench/torch_reference.py's step builder trains the
shape it is given and counts FLOPs as eqtrain's flops_per_token does (the MFU of both sides)."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
from helpers import load_script


def load(name: str):
    return load_script(name, "bench")


pairs = load("pairs")


class FakeClock:
    """Time advances only when a stand-in step runs: each step's duration is exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stand_ins(clock: FakeClock, durations: dict[str, list[float]], log: list[str]):
    """Steps that append their name to `log` and advance the clock by their next duration."""
    def make(name):
        queue = iter(durations[name])

        def step():
            log.append(name)
            clock.now += next(queue)
        return step
    return {name: make(name) for name in durations}


def test_pairs_alternate_order_after_warmup_and_take_per_pair_medians():
    clock, log = FakeClock(), []
    # warm-up (2 each) then 3 pairs of k=3: ours one slow outlier step per pair (the median drops it)
    ours = [9.0, 9.0] + [1.0, 5.0, 1.0] + [2.0, 2.0, 7.0] + [1.0, 1.0, 1.0]
    ref = [9.0, 9.0] + [2.0, 2.0, 2.0] + [3.0, 3.0, 3.0] + [4.0, 4.0, 4.0]
    steps = stand_ins(clock, {"ours": ours, "ref": ref}, log)
    results = pairs.run_pairs(steps, pairs=3, k=3, warmup=2, clock=clock)

    assert log[:4] == ["ours", "ours", "ref", "ref"]  # both warmed before any timing
    timed = log[4:]
    blocks = [timed[i] for i in range(0, len(timed), 3)]
    assert blocks == ["ours", "ref", "ref", "ours", "ours", "ref"]  # k steps each, order flipping per pair
    assert results == [{"ours": 1.0, "ref": 2.0}, {"ours": 2.0, "ref": 3.0}, {"ours": 1.0, "ref": 4.0}]
    # ratio = tokens/s ours / tokens/s ref = time ref / time ours (> 1: ours faster)
    assert pairs.ratios(results, "ours", "ref") == [2.0, 1.5, 4.0]
    assert pairs.summary(results, "ours") == {"ref": 2.0}


def test_three_implementations_reverse_order_and_summarise_each_reference():
    clock, log = FakeClock(), []
    durations = {"a": [1.0] * 4, "b": [2.0] * 4, "c": [0.5] * 4}
    results = pairs.run_pairs(stand_ins(clock, durations, log), pairs=2, k=1, warmup=1, clock=clock)
    assert log == ["a", "b", "c", "a", "b", "c", "c", "b", "a"]
    assert pairs.summary(results, "a") == {"b": 2.0, "c": 0.5}


def test_pairs_rejects_nonpositive_counts():
    with pytest.raises(ValueError, match="pairs=0"):
        pairs.run_pairs({"a": lambda: None}, pairs=0)


def test_step_speed_without_torch_says_how_to_install_before_building(monkeypatch):
    step_speed = load("step_speed")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real_find_spec(n, *a))

    def built(*_):
        raise AssertionError("the trainer was built before the torch check")
    monkeypatch.setattr(step_speed.T, "build_trainer", built)
    monkeypatch.setattr(sys, "argv", ["step_speed.py", "--pairs", "1"])
    with pytest.raises(SystemExit) as stop:
        step_speed.main()
    assert stop.value.code == 'step_speed.py --pairs needs PyTorch: pip install -e ".[dev,parity]"'


def test_torch_reference_trains_its_shape_and_counts_flops_like_eqtrain():
    pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
    from models import flops_per_token
    from models.gpt import GPTConfig

    ref = load("torch_reference")
    shape = ref.Shape(vocab=64, context=16, dim=32, heads=2, blocks=2, mlp=4, batch=4)
    step, n_params = ref.build_step(shape)
    # tied GPT-2: embeddings V*D + positions T*D + per block 12 D^2 + 13 D (+ 2 LayerNorms 4 D) + final LN 2 D
    d = shape.dim
    assert n_params == (shape.vocab + shape.context) * d + shape.blocks * (12 * d * d + 13 * d) + 2 * d
    losses = [step() for _ in range(5)]
    assert abs(losses[0] - math.log(shape.vocab)) < 0.2  # GPT-2 init: near-uniform logits at the start
    assert losses[-1] < losses[0]  # AdamW on one fixed batch lowers its loss
    config = GPTConfig(dim=d, num_heads=shape.heads, num_blocks=shape.blocks, context_length=shape.context,
                       vocab_size=shape.vocab, mlp_ratio=shape.mlp)
    tokens = shape.batch * shape.context
    # float64 products and sums of integers below 2^53 on both sides: exact but for the order; 1e-12 is room
    assert ref.flops_per_step(shape) == pytest.approx(flops_per_token(config, shape.context) * tokens, rel=1e-12)


def test_torch_reference_in_bfloat16_is_autocast_mixed_precision():
    """dtype="bfloat16" (eqtrain's train.compute_dtype, what a GPU comparison runs): the forward in
    bf16 under autocast, so its losses differ from float32's by bf16 rounding (~2^-8 relative), not
    by more, and it still trains; float16 (it would need a GradScaler) is refused."""
    pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
    ref = load("torch_reference")
    shape = ref.Shape(vocab=64, context=16, dim=32, heads=2, blocks=2, mlp=4, batch=4)
    step32, _ = ref.build_step(shape)
    step16, _ = ref.build_step(shape, dtype="bfloat16")
    losses32, losses16 = [step32() for _ in range(5)], [step16() for _ in range(5)]
    assert losses16 != losses32  # autocast is on: the bf16 forward rounds differently
    assert all(abs(a - b) < 0.05 * abs(a) for a, b in zip(losses32, losses16))  # ... by bf16 rounding only
    assert losses16[-1] < losses16[0]
    with pytest.raises(ValueError, match="float16"):
        ref.build_step(shape, dtype="float16")


def test_step_speed_pairs_refuses_what_the_reference_cannot_build_before_compiling(monkeypatch):
    pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
    step_speed = load("step_speed")

    def built(*_):
        raise AssertionError("the trainer was built before the check")
    monkeypatch.setattr(step_speed.T, "build_trainer", built)
    for override, says in (("train.compute_dtype=float16", "compute_dtype=float32 or bfloat16, not float16"),
                           ("model=llama_tiny", "plain GPT-2")):
        monkeypatch.setattr(sys, "argv", ["step_speed.py", "--pairs", "1", override])
        with pytest.raises(SystemExit) as stop:
            step_speed.main()
        assert says in str(stop.value.code), stop.value.code
