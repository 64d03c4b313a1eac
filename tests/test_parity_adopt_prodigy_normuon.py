"""Parity tier: ADOPT, Prodigy and NorMuon against pytorch_optimizer's, same weights and gradients,
6 steps, ours through `make_optimizer` (the run's cosine schedule, per-group lrs, the default decay
groups) or the group's own transform, the reference in float64 with each group's lr set by hand.

Where the reference is not the paper's or optax's algorithm, it is set up to be the same:
  * ADOPT: pytorch_optimizer (as the authors' code) counts the v-only first step and clips the
    first real update at 2^(1/4); optax and the paper clip update t+1 at t^(1/4): the reference
    gets clip_lambda = (step − 1)^(1/4). Weight decay decoupled (weight_decouple) on both.
  * Prodigy: optax always applies Adam's bias correction: the reference's `bias_correction=True`
    (its default, and the authors', is off). The reference shares one d over its parameter
    groups, ours learns one per group: one reference optimizer per group. d0 = 1e-3 and weights
    of that size, so that x_0 − x (what d is estimated from) keeps float32's precision on our side
    (at d0 = 1e-6 the first steps are ~1e-7 against weights of ~1: x_0 − x would keep one digit).
  * NorMuon: Newton–Schulz in float64 (the reference's default is bfloat16; its coefficients,
    Frobenius pre-scaling and wide-side iteration are optax's). Without Nesterov the momenta
    differ by the factor 1/(1 − β^t), which the Frobenius pre-scaling removes (up to the
    pre-scaling's eps: 1e-8 added here, a 1e-7 floor there, < 0.1 EPS32 of norms >= 1). With it,
    optax's blend (Muon's, ours) bias-corrects its two terms separately,
    β·m/(1 − β^(t+1)) + (1 − β)·g/(1 − β^t), the reference's blends them uncorrected: its
    Newton–Schulz is handed optax's blend, made from its own momentum buffer and gradient.
    PyTorch's weights are out×in, ours d_in×d_out: the reference steps the transposes.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import optax
import pytest
from helpers import EPS32, rounding_rtol, sum_atol

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason=REASON)

from test_groups import newton_schulz_atol  # noqa: E402
from test_parity_basics import SMALL, STEPS, assert_same_weights, cosine, ours, problem, reference  # noqa: E402

from optimizer import make_optimizer  # noqa: E402
from optimizer.adopt import ADOPT  # noqa: E402
from optimizer.groups import decayed_groups  # noqa: E402
from optimizer.normuon import NorMuon  # noqa: E402
from optimizer.prodigy import Prodigy  # noqa: E402
from optimizer.schedules import SCHEDULES  # noqa: E402
from utils.sections import build_section  # noqa: E402

# --- ADOPT -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [True, False])
def test_adopt_matches_pytorch_optimizer_adopt(clip):
    """Update 1 only sets v (the decay still applies, in both); then g/max(√v_prev, eps), clipped
    at ±t^(1/4), averaged at b1, times −lr; decay p·(1 − lr·wd) on the starting p, as ours.
    With the clip, gradients of mixed sizes so that it binds on some components (checked); without,
    gradients of one size, so that the steps stay ~lr, as assert_same_weights' bound assumes (the
    mixed ones, unclipped, step up to ~40·lr)."""
    hp = ADOPT(b1=0.9, b2=0.999, eps=1e-6, clip=clip, weight_decay=0.1)
    params, grads = problem(SMALL, seed=6)
    if clip:
        rng = np.random.default_rng(7)
        grads = [{k: (g * rng.choice([0.2, 1.0, 8.0], size=g.shape)).astype(np.float32) for k, g in step.items()}
                 for step in grads]
        assert _adopt_clipped_fraction(hp, grads) > 0.01
    got = ours(hp, SMALL, params, grads, cosine())
    clip_lambda = (lambda step: (step - 1) ** 0.25) if clip else None
    want = reference(lambda groups: pytorch_optimizer.ADOPT(groups, betas=(hp.b1, hp.b2), eps=hp.eps,
                                                            clip_lambda=clip_lambda, weight_decouple=True,
                                                            foreach=False),
                     SMALL, params, grads, cosine(), hp.weight_decay)
    assert_same_weights(got, want, params, f"adopt clip={clip}")


def _adopt_clipped_fraction(hp: ADOPT, grads) -> float:
    """The share of components, over updates 2.., whose |g/max(√v_prev, eps)| exceeds the clip, in float64."""
    v = {k: np.asarray(g, np.float64) ** 2 for k, g in grads[0].items()}
    clipped = total = 0
    for t, step in enumerate(grads[1:], 1):
        for k, g in step.items():
            normed = np.abs(g) / np.maximum(np.sqrt(v[k]), hp.eps)
            clipped, total = clipped + np.sum(normed > t**0.25), total + g.size
            v[k] = hp.b2 * v[k] + (1 - hp.b2) * np.asarray(g, np.float64) ** 2
    return clipped / total


# --- Prodigy ---------------------------------------------------------------------------------------

PRODIGY_D0 = 1e-3
# d grows once the distance travelled outgrows the steps (d̂ ≈ d·lr·c_t·t/2 on gradients that keep
# their direction): a dozen updates.
PRODIGY_STEPS = 12
PRODIGY_PEAKS = {"hidden": 1.0, "embed": 0.5, "head": 0.8, "scalar": 1.0}  # lr multipliers of d


def _prodigy_problem():
    """Weights of d0's size; gradients with a fixed direction under the noise, so that they line up
    with the distance travelled and d grows (random gradients alone give d̂ < d: d would stay d0)."""
    rng = np.random.default_rng(8)
    params = {k: (PRODIGY_D0 * rng.normal(size=shape)).astype(np.float32) for k, (shape, _) in SMALL.items()}
    drift = {k: rng.normal(size=shape) for k, (shape, _) in SMALL.items()}
    grads = [{k: (drift[k] + 0.5 * rng.normal(size=shape)).astype(np.float32) for k, (shape, _) in SMALL.items()}
             for _ in range(PRODIGY_STEPS)]
    return params, grads


def _prodigy_schedule():
    return build_section(SCHEDULES["cosine"], {"lr": 1.0, "warmup": 2, "max_steps": PRODIGY_STEPS},
                         "optimizer.lr_config").build(PRODIGY_STEPS)


def prodigy_rtol(n: int, conditioning: float, steps: int) -> float:
    """rtol of our float32 d (and so of each step, which d scales) against the float64 reference
    after `steps` updates. d̂ = Σλ·⟨g, x_0 − x⟩ / Σ|s|: each update adds to the numerator a dot
    product of n terms, whose float32 error is sum_atol(n, Σ|g·(x_0 − x)|), `conditioning` times
    its value at most (measured on the reference, float64), and to the denominator n positive
    terms (relative sum_atol(n, 1)); their ratio errs by the sum of both, plus a few roundings (the
    weights λ = (d/d0)·d·lr·c_t, the EMAs, the division: rounding_rtol(8)). An error in d scales
    the next steps and so x_0 − x in every later dot product by as much: the errors add up over
    the updates (first order), `steps` of them."""
    per_update = sum_atol(n, conditioning) + sum_atol(n, 1.0) + rounding_rtol(8)
    return steps * per_update


def test_prodigy_matches_pytorch_optimizer_prodigy():
    """One reference Prodigy per group (ours learns d per group), bias correction on, decay on the
    decayed groups (decoupled, times d·lr·c_t on the starting p, as ours); each group's lr
    multiplier set per step from the cosine schedule. After every update the d of each group and
    the weights are compared; d must have grown, or the comparison would say little."""
    wd = 0.1
    hp = Prodigy(b2=0.99, d0=PRODIGY_D0, weight_decay=wd)  # b2 0.99: c_t nearer 1, so d grows within 6 updates
    params, grads = _prodigy_problem()
    schedule = _prodigy_schedule()
    labels = {k: label for k, (_, label) in SMALL.items()}
    overrides = {g: {"lr": lr} for g, lr in PRODIGY_PEAKS.items()}
    tx = make_optimizer(hp, schedule, labels, None, 1.0, overrides)
    from optimizer.diagnostics import optimizer_metrics

    @jax.jit
    def step(p, state, g):
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
        return p, state, optimizer_metrics(hp, state, p, overrides)

    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    decayed = decayed_groups(False)
    refs = {k: pytorch_optimizer.Prodigy([tensors[k]], lr=1.0, betas=(hp.b1, hp.b2), beta3=None, d0=PRODIGY_D0,
                                         d_coef=1.0, growth_rate=float("inf"),
                                         weight_decay=wd if label in decayed else 0.0, weight_decouple=True,
                                         fixed_decay=False, bias_correction=True, safeguard_warmup=False,
                                         eps=hp.eps, foreach=False)
            for k, label in labels.items()}
    p, state = dict(params), tx.init(params)
    p0 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    worst = {k: 1.0 for k in labels}  # the dot products' conditioning, Σ|g·(x_0 − x)| / |⟨g, x_0 − x⟩|
    path = {k: np.zeros_like(v) for k, v in p0.items()}  # Σ|step| per weight, the reference's
    for t, g in enumerate(grads):
        for k, label in labels.items():
            before = tensors[k].numpy().copy()
            terms = np.asarray(g[k], np.float64) * (p0[k] - before)
            worst[k] = max(worst[k], np.abs(terms).sum() / max(abs(terms.sum()), 1e-300))
            refs[k].param_groups[0]["lr"] = float(schedule(t)) * PRODIGY_PEAKS[label]
            tensors[k].grad = torch.tensor(g[k], dtype=torch.float64)
            refs[k].step()
            path[k] += np.abs(tensors[k].numpy() - before)
        p, state, metrics = step(p, state, g)
        for k, label in labels.items():
            rtol = prodigy_rtol(tensors[k].numel(), worst[k], t + 1)
            d_ours, d_ref = float(metrics[f"optim/{label}/d"]), refs[k].param_groups[0]["d"]
            assert abs(d_ours - d_ref) <= rtol * d_ref, f"d of {label}, update {t + 1}: {d_ours} vs {d_ref}"
            # The weights: the steps so far (each <= its size·rtol off) plus apply_updates' rounding
            # per update (EPS32/2 of |p|, 2x margin).
            bound = rtol * path[k] + (t + 1) * EPS32 * np.abs(tensors[k].numpy())
            err = np.abs(np.asarray(p[k], np.float64) - tensors[k].numpy())
            assert np.all(err <= 2 * bound), f"{k}, update {t + 1}: {err.max():.3g} (bound {2 * bound.max():.3g})"
    for k, label in labels.items():
        assert refs[k].param_groups[0]["d"] > 1.05 * PRODIGY_D0, (label, refs[k].param_groups[0]["d"])  # d grew


# --- NorMuon ---------------------------------------------------------------------------------------

NORMUON_LR = 0.02
# Stacked hidden leaves (blocks, d_in, d_out): wide and tall blocks; the reference steps each block's
# transpose (out×in) as its own parameter.
NORMUON_SHAPES = {"wide": (2, 8, 12), "tall": (2, 12, 8)}


@functools.cache
def _float64_newton_schulz():
    from pytorch_optimizer.optimizer.muon import normuon as module

    original = module.zero_power_via_newton_schulz_5
    return module, lambda g, **kw: original(g, **{**kw, "dtype": torch.float64})


def normuon_atol(o: np.ndarray, v: np.ndarray, u: np.ndarray, ns_steps: int, rms_max: float) -> float:
    """atol of one block of NorMuon's update (before the lr and the shape factor) in float32
    against float64, from the float64 Newton–Schulz output `o` (d_in×d_out), the neuron second
    moments `v` (d_out) after the update, the reference's update `u` and `rms_max`, the largest
    column RMS of any update's o so far. U = O·w·s, w_j = 1/(√v_j + eps), s = T/‖O·w‖:
      * O errs by at most a = newton_schulz_atol per element (that bound is for two float32 sides;
        one against float64 errs less), which reaches U times w_j·s: a·max(w)·s;
      * v_j, an EMA of column mean squares, by 2·a·rms_max (a square's first-order error), so
        √v_j and w_j by a·rms_max/v_j relative: at most a·rms_max/min(v), and U by that times |U|;
      * ‖O·w‖ and T = ‖O‖ by a·√(m·n)·max(w)/‖O·w‖ and a·√(m·n)/‖O‖ relative (the perturbation's
        norm), and U by those times |U|; the float32 roundings of the stage itself (a mean of m
        squares, a sum of m·n, a square root, two divisions, a product: sum_atol(m·n, 1) +
        rounding_rtol(6) relative) are far below and taken with them. 2x margin."""
    a = newton_schulz_atol(ns_steps, max(o.shape), o)
    w = 1.0 / (np.sqrt(v) + NorMuon().eps)
    ow = np.linalg.norm(o * w)
    s = np.linalg.norm(u) / ow  # ‖U‖ = T = s·‖O·w‖
    mn = o.size
    relative = (a * rms_max / v.min() + a * math.sqrt(mn) * w.max() / ow + a * math.sqrt(mn) / np.linalg.norm(o)
                + sum_atol(mn, 1.0) + rounding_rtol(6))
    return 2 * (a * w.max() * s + relative * np.abs(u).max())


@pytest.mark.parametrize("shape_scale, update_scale, nesterov", [
    ("reference", "preserve_norm", False), ("adam_rms", "match_rms", False), ("reference", "preserve_norm", True)])
def test_normuon_matches_pytorch_optimizer_normuon(monkeypatch, shape_scale, update_scale, nesterov):
    """The hidden group per block: momentum (Nesterov: optax's blend), Newton–Schulz, each output neuron's
    column divided by √v + eps, the block rescaled (to its Newton–Schulz norm times √max(1,
    d_out/d_in) with `reference`, to RMS 0.2 with `adam_rms`), decay p·(1 − lr·wd) on the starting
    p, −lr·that. The Newton–Schulz outputs the reference computed are recorded; each step is
    compared block by block within normuon_atol of them, times the lr and the shape factor."""
    module, float64_ns = _float64_newton_schulz()
    outputs, now = [], {}  # now: this update's count and gradients, the reference's order

    def newton_schulz(x, **kw):
        if nesterov:  # optax's bias-corrected blend from the reference's buffer and gradient
            t, param = now["t"], now["params"][len(outputs)]
            mu, g = opt.state[param]["momentum_buffer"], now["grads"][len(outputs)]
            x = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
        outputs.append(float64_ns(x, **kw))
        return outputs[-1]

    monkeypatch.setattr(module, "zero_power_via_newton_schulz_5", newton_schulz)
    wd, beta, beta2 = 0.1, 0.9, 0.9
    hp = NorMuon(momentum=beta, nesterov=nesterov, b2=beta2, shape_scale=shape_scale, weight_decay=wd)
    rng = np.random.default_rng(9)
    params = {k: (NORMUON_LR * rng.normal(size=s)).astype(np.float32) for k, s in NORMUON_SHAPES.items()}
    # Columns of unequal sizes, so the neurons' second moments differ and the normalisation matters.
    col_scale = {k: rng.choice([0.3, 1.0, 3.0], size=s[-1]) for k, s in NORMUON_SHAPES.items()}
    grads = [{k: (rng.normal(size=s) * col_scale[k]).astype(np.float32) for k, s in NORMUON_SHAPES.items()}
             for _ in range(STEPS)]
    tx = hp.transform("hidden", optax.constant_schedule(NORMUON_LR))

    @jax.jit
    def step(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    blocks = {(k, b): torch.tensor(params[k][b].T.astype(np.float64)) for k in NORMUON_SHAPES for b in range(2)}
    opt = pytorch_optimizer.NorMuon([{"params": list(blocks.values()), "use_muon": True}], lr=NORMUON_LR,
                                    momentum=hp.momentum, beta2=beta2, weight_decay=wd, weight_decouple=True,
                                    nesterov=nesterov, ns_steps=hp.ns_steps, update_scale=update_scale,
                                    use_adjusted_lr=False, eps=hp.eps, foreach=False)
    p, state = dict(params), tx.init(params)
    rms_max = {key: 0.0 for key in blocks}
    spread = 1.0
    for step_count, g in enumerate(grads, 1):
        before = {key: t.numpy().copy() for key, t in blocks.items()}
        for (k, b), t in blocks.items():
            t.grad = torch.tensor(g[k][b].T.astype(np.float64))
        now.update(t=step_count, params=list(blocks.values()), grads=[t.grad.clone() for t in blocks.values()])
        outputs.clear()
        opt.step()
        p, state = step(p, state, g)
        for (key, t), o in zip(blocks.items(), outputs, strict=True):
            k, b = key
            o = o.numpy().T  # d_in×d_out, as ours
            v = opt.state[t]["second_momentum_buffer"].numpy()[:, 0]
            rms_max[key] = max(rms_max[key], np.sqrt(np.mean(o**2, axis=0)).max())
            spread = max(spread, np.sqrt(v.max() / v.min()))
            d_in, d_out = o.shape
            factor = math.sqrt(max(1.0, d_out / d_in)) if shape_scale == "reference" else 1.0
            decayed = before[key].T * (1 - NORMUON_LR * wd)
            want = (t.numpy().T - decayed) / (-NORMUON_LR * factor)  # the reference's U, recovered
            got = (np.asarray(p[k][b], np.float64) - decayed) / (-NORMUON_LR * factor)
            # Recovering U from the weights: each weight (and its decay) rounds once on our side,
            # EPS32/2 of |p| (2 roundings, 2x margin), divided by the step's lr·factor.
            recovery = 2 * EPS32 * np.abs(before[key]).max() / (NORMUON_LR * factor)
            atol = normuon_atol(o, v, want, hp.ns_steps, rms_max[key]) + recovery
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"{k}[{b}] ({shape_scale}, {nesterov=})")
    assert spread > 1.5  # the neurons' second moments differ: the normalisation did something
