"""The parity tier, first pairs: our AdamW, SGDM (heavy ball and Nesterov), Lion and Adafactor
against PyTorch's reference implementations, and the cautious mask (optimizer.cautious) against
pytorch_optimizer's cautious Lion and AdaFactor. Each pair runs several steps of the same
gradients on small matrices in four parameter groups, ours through `make_optimizer` with the
run's own cosine schedule, per-group lrs and the default decay groups, the reference in float64
with the same lr per group and step set by hand; the final weights must agree to float32 rounding.

Pairs that are not the same algorithm are aligned or left out, each where it is set up:
torch.optim.SGD's weight_decay is L2 folded into the gradient (ours is decoupled: the reference
decays by hand); optax factors Adafactor's second moment only where both sides are >= 128 while
the PyTorch ports factor every matrix (the Adafactor pairs use such matrices); transformers' and
pytorch_optimizer's Adafactor momentum averages lr-scaled updates (ours the updates: equal under
a constant lr, which the momentum pair uses); pytorch_optimizer 4.1 rescales the cautious mask by
numel/(kept + 1), the paper's first release, where ours divides by max(kept fraction, 1e-3), the
paper's current code and timm's: the cautious pairs give the reference that one line
(`apply_cautious`), so the rest (where the mask sits against momentum, lr and decay) is what is
compared. Muon, Shampoo and the optimizers added with their own parity tests are elsewhere.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from helpers import EPS32, trained_params

from optimizer import make_optimizer
from optimizer.adafactor import Adafactor
from optimizer.adamw import AdamW
from optimizer.cautious import MIN_KEPT
from optimizer.groups import GROUPS
from optimizer.lion import Lion
from optimizer.schedules import SCHEDULES
from optimizer.sgdm import SGDM
from utils.sections import build_section

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason=REASON)

from transformers.optimization import Adafactor as HFAdafactor  # noqa: E402  (imports torch: after the skip)

STEPS = 6
BASE_LR = 1e-2
# Each group's peak lr, written out (not read from our group plumbing): embed and head overridden.
PEAKS = {"hidden": BASE_LR, "embed": 3e-3, "head": 5e-3, "scalar": BASE_LR}
OVERRIDES = {"embed": {"lr": 3e-3}, "head": {"lr": 5e-3}}
DECAYED = ("hidden", "head")  # decoupled decay's default groups (decay_embeddings=false)
SMALL = {"w": ((12, 16), "hidden"), "h": ((16, 10), "head"), "e": ((10, 12), "embed"), "b": ((16,), "scalar")}
# optax factors a matrix only where both sides are >= 128; the PyTorch ports factor every matrix.
FACTORED = {"w": ((128, 136), "hidden"), "h": ((136, 128), "head"), "b": ((128,), "scalar")}


def cosine():
    """The run's own cosine schedule: warmup 2 steps, then down to lr/10 on the last update."""
    return build_section(SCHEDULES["cosine"], {"lr": BASE_LR, "warmup": 2, "max_steps": STEPS},
                         "optimizer.lr_config").build(STEPS)


def problem(shapes, seed=0):
    """(params, [grads per step]) as float32 NumPy: the same numbers for both sides."""
    rng = np.random.default_rng(seed)
    draw = lambda: {k: rng.normal(size=shape).astype(np.float32) for k, (shape, _) in shapes.items()}
    return draw(), [draw() for _ in range(STEPS)]


def ours(hp, shapes, params, grads, schedule, cautious=False) -> dict[str, np.ndarray]:
    labels = {k: label for k, (_, label) in shapes.items()}
    tx = make_optimizer(hp, schedule, labels, None, BASE_LR, OVERRIDES, cautious=cautious)
    return {k: np.asarray(v, np.float64) for k, v in trained_params(tx, params, grads).items()}


def reference(build, shapes, params, grads, schedule, weight_decay, decay_by_hand=False) -> dict[str, np.ndarray]:
    """`build(param_groups)` -> a torch optimizer, stepped in float64 with group g at
    schedule(t)·PEAKS[g]/BASE_LR on step t (optax counts updates from 0) and weight_decay on the
    DECAYED groups; `decay_by_hand`: p ← p·(1 − lr·wd) before each step (decoupled, as AdamW)."""
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    groups = [{"params": [tensors[k] for k, (_, label) in shapes.items() if label == g], "group": g,
               "weight_decay": 0.0 if decay_by_hand or g not in DECAYED else weight_decay}
              for g in GROUPS if any(label == g for _, label in shapes.values())]
    for group in groups:
        group["lr"] = PEAKS[group["group"]]
    opt = build(groups)
    for t, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = float(schedule(t)) * PEAKS[group["group"]] / BASE_LR
            if decay_by_hand and group["group"] in DECAYED:
                for p in group["params"]:
                    p.mul_(1.0 - group["lr"] * weight_decay)
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k], dtype=torch.float64)
        opt.step()
    return {k: v.numpy() for k, v in tensors.items()}


def assert_same_weights(got, want, params, label):
    """float32 against float64. Per step, apply_updates rounds each weight (<= EPS32/2 of |p|)
    and the update carries its own roundings (a few EPS32 of its size, <= lr·(a few) here): over
    STEPS steps <= STEPS·EPS32·(|p| + 1) with the lrs <= 1e-2 used here; 4x room. The weights
    must also have moved far beyond that, or the comparison would say nothing. (Measured: <= 0.3
    of STEPS·EPS32·(|p| + 1) for every pair here; the weights moved > 800 bounds.)"""
    for k in want:
        bound = 4 * STEPS * EPS32 * (np.abs(want[k]) + 1.0)
        err = np.abs(got[k] - want[k])
        assert np.all(err <= bound), f"{label} {k}: max error {err.max():.3g} (bound {bound.max():.3g})"
        assert np.abs(want[k] - params[k]).max() > 100 * bound.max(), f"{label} {k}: the weights barely moved"


def test_adamw_matches_torch_adamw():
    """torch.optim.AdamW: the same bias corrections and eps placement (m̂/(√v̂ + eps)), decay
    p·(1 − lr·wd) before the Adam step (on the same p: equal to ours)."""
    hp = AdamW(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    params, grads = problem(SMALL)
    got = ours(hp, SMALL, params, grads, cosine())
    want = reference(lambda groups: torch.optim.AdamW(groups, betas=(hp.b1, hp.b2), eps=hp.eps, foreach=False),
                     SMALL, params, grads, cosine(), hp.weight_decay)
    assert_same_weights(got, want, params, "adamw")


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgdm_matches_torch_sgd_with_decoupled_decay(nesterov):
    """torch.optim.SGD (dampening 0: buf = m·buf + g; Nesterov steps along g + m·buf) with its L2
    weight_decay off and the decoupled decay done by hand, which is ours (decay after momentum)."""
    hp = SGDM(momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    params, grads = problem(SMALL, seed=1)
    got = ours(hp, SMALL, params, grads, cosine())
    want = reference(lambda groups: torch.optim.SGD(groups, momentum=hp.momentum, nesterov=nesterov, foreach=False),
                     SMALL, params, grads, cosine(), hp.weight_decay, decay_by_hand=True)
    assert_same_weights(got, want, params, f"sgdm nesterov={nesterov}")


def _lion_margin(hp, grads):
    """min over steps and components of |b1·m + (1 − b1)·g| / its max, in float64: Lion steps by
    its sign, so a component within float32 rounding (~1e-7) of 0 could flip either way. These
    data keep every one far from that."""
    m = {k: np.zeros_like(g, np.float64) for k, g in grads[0].items()}
    margin = 1.0
    for g in grads:
        for k in g:
            c = hp.b1 * m[k] + (1 - hp.b1) * g[k]
            margin = min(margin, np.abs(c).min() / np.abs(c).max())
            m[k] = hp.b2 * m[k] + (1 - hp.b2) * g[k]
    return margin


def test_lion_matches_pytorch_optimizer_lion():
    """pytorch_optimizer.Lion (weight_decouple: p·(1 − lr·wd), then −lr·sign(b1·m + (1 − b1)·g))."""
    hp = Lion(b1=0.9, b2=0.99, weight_decay=0.3)
    params, grads = problem(SMALL, seed=3)
    assert _lion_margin(hp, grads) > 1e-5
    got = ours(hp, SMALL, params, grads, cosine())
    want = reference(lambda groups: pytorch_optimizer.Lion(groups, betas=(hp.b1, hp.b2), foreach=False),
                     SMALL, params, grads, cosine(), hp.weight_decay)
    assert_same_weights(got, want, params, "lion")


def test_adafactor_matches_transformers_adafactor():
    """transformers' Adafactor (the fairseq port) with relative_step/scale_parameter off and no
    momentum: the same factored second moment (β2_t = 1 − t^-0.8, eps 1e-30 on g²), the same
    update-RMS clipping at 1, decay p·(1 − lr·wd) before the step. optax keeps the row statistic
    of the longer side; the reconstruction row ⊗ col / mean(row) is the same either way."""
    hp = Adafactor(weight_decay=0.1)
    params, grads = problem(FACTORED, seed=3)
    got = ours(hp, FACTORED, params, grads, cosine())
    want = reference(lambda groups: HFAdafactor(groups, lr=BASE_LR, scale_parameter=False, relative_step=False,
                                                warmup_init=False, decay_rate=-hp.decay_rate,
                                                clip_threshold=hp.clipping_threshold, beta1=None),
                     FACTORED, params, grads, cosine(), hp.weight_decay)
    assert_same_weights(got, want, params, "adafactor")


# --- the cautious mask ---------------------------------------------------------------------------


def _apply_cautious(update, grad):
    """Ours: keep where the update (subtracted from p) agrees with the gradient, rescale by
    1/max(kept fraction, MIN_KEPT)."""
    mask = (update * grad > 0).to(grad.dtype)
    update.mul_(mask / mask.mean().clamp(min=MIN_KEPT))


class _CautiousLion(pytorch_optimizer.Lion):
    apply_cautious = staticmethod(_apply_cautious)


class _CautiousAdaFactor(pytorch_optimizer.AdaFactor):
    apply_cautious = staticmethod(_apply_cautious)


def test_cautious_lion_matches_pytorch_optimizer_cautious_lion():
    """C-Lion: the mask on sign(b1·m + (1 − b1)·g) against g, then −lr·masked; the decay
    p·(1 − lr·wd) unmasked. Half or so of each step's components are dropped after step 1."""
    hp = Lion(b1=0.9, b2=0.99, weight_decay=0.3)
    params, grads = problem(SMALL, seed=4)
    assert _lion_margin(hp, grads) > 1e-5
    got = ours(hp, SMALL, params, grads, cosine(), cautious=True)
    want = reference(lambda groups: _CautiousLion(groups, betas=(hp.b1, hp.b2), foreach=False, cautious=True),
                     SMALL, params, grads, cosine(), hp.weight_decay)
    assert_same_weights(got, want, params, "cautious lion")
    plain = ours(hp, SMALL, params, grads, cosine())
    assert max(np.abs(plain[k] - want[k]).max() for k in want) > 1e-3  # the mask changed the weights


def test_cautious_adafactor_with_momentum_matches_pytorch_optimizer():
    """C-AdaFactor with momentum 0.9 under a constant lr: the mask on the momentum of the clipped
    factored update against g, the decay unmasked. pytorch_optimizer's β2_t is capped at 0.999,
    which 1 − t^-0.8 reaches only after ~5,600 steps; relative_step and scale_parameter off."""
    hp = Adafactor(b1=0.9, weight_decay=0.1)
    params, grads = problem(FACTORED, seed=5)
    constant = optax.constant_schedule(BASE_LR)
    got = ours(hp, FACTORED, params, grads, constant, cautious=True)
    want = reference(lambda groups: _CautiousAdaFactor(
        groups, betas=(hp.b1, 0.999), decay_rate=-hp.decay_rate, clip_threshold=hp.clipping_threshold,
        scale_parameter=False, relative_step=False, momentum_dtype=torch.float64, foreach=False, cautious=True),
        FACTORED, params, grads, constant, hp.weight_decay)
    assert_same_weights(got, want, params, "cautious adafactor")
    plain = ours(hp, FACTORED, params, grads, constant)
    assert max(np.abs(plain[k] - want[k]).max() for k in want) > 1e-4  # the mask changed the weights
