"""Parity tier: Scion against pytorch_optimizer's SCION (4.1), which follows the authors' scion.py
(LIONS-EPFL/scion: the same LMOs, momentum buffer `d.lerp_(g, momentum)` = (1 − α)·d + α·g from 0,
and constrained p·(1 − lr) − lr·ρ·lmo; it adds decoupled weight decay to the unconstrained variant,
which ours is too). Ours through `make_optimizer` (the run's cosine schedule, per-group lrs, the
default decay groups), the reference in float64 stepping each group at its lr by hand, 6 steps on
the same weights and gradients; the weights are compared after every step.

Aligned where the two are not the same computation:
  * the reference's Newton–Schulz runs in float64 (its default is bfloat16; its coefficients,
    Frobenius normalisation and wide-side iteration are ours); it floors ‖X‖ at 1e-7 where ours
    (the authors') adds 1e-7: the momenta here have ‖X‖ >= 10, so the two differ by < 1e-8 of X,
    0.1 EPS32 (checked);
  * PyTorch's matrices are out×in, ours d_in×d_out: the reference steps each block's transpose
    (the embeddings are V×D on both sides, as torch's nn.Embedding), a stacked leaf one parameter
    per block;
  * momentum 0.75 (the reference's 0.25) and integer gradients in [−64, 64]: 0.75·m + 0.25·g of
    such numbers is exact in float32 for these 6 steps (< 24 significant bits), so both sides'
    LMOs see the same momentum and the comparison measures the LMOs and the step alone.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from helpers import EPS32, rounding_rtol, sum_atol

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason=REASON)

import jax  # noqa: E402
import optax  # noqa: E402
from pytorch_optimizer.optimizer import scion as scion_module  # noqa: E402
from pytorch_optimizer.optimizer.scion import LMONorm  # noqa: E402
from test_groups import newton_schulz_atol  # noqa: E402
from test_parity_basics import BASE_LR, OVERRIDES, PEAKS, STEPS, cosine  # noqa: E402

from optimizer import make_optimizer  # noqa: E402
from optimizer.groups import group_hparams  # noqa: E402
from optimizer.scion import Scion  # noqa: E402

# name: (shape, group). hidden: a wide and a tall stack of 2 blocks; the embeddings V×D, the head D×V,
# a bias and a stack of norm gains. D = 16, a power of 2: Sign's 1/D is exact.
SHAPES = {"w": ((2, 8, 12), "hidden"), "t": ((2, 12, 8), "hidden"), "e": ((10, 16), "embed"),
          "h": ((16, 10), "head"), "b": ((16,), "scalar"), "s": ((2, 16), "scalar")}
MOMENTUM = 0.75
EMBED = {"sign": (LMONorm.SIGN, {}), "col": (LMONorm.COL, {"transpose": True}),
         "row": (LMONorm.ROW, {"transpose": True, "normalized": False})}
HEAD = {"sign": (LMONorm.SIGN, {}), "spectral": (LMONorm.SPECTRAL, {"num_steps": 5})}
SCALAR = {"bias_rms": (LMONorm.BIAS, {}), "none": (LMONorm.NONE, {})}


def _blocks(k: str, x: np.ndarray) -> list[np.ndarray]:
    """Our leaf as the reference's parameters: each block, hidden and head ones transposed to out×in."""
    shape, group = SHAPES[k]
    blocks = list(x) if len(shape) == 3 or (group == "scalar" and len(shape) == 2) else [x]
    return [b.T if group in ("hidden", "head") else b for b in blocks]


@functools.cache
def _float64_newton_schulz():
    original = scion_module.zero_power_via_newton_schulz_5
    return lambda g, num_steps=5, **kw: original(g, num_steps, **{**kw, "dtype": torch.float64})


def _lmo_atol(hp: Scion, group: str, m: np.ndarray, ref_lmo: np.ndarray) -> float:
    """atol of our float32 lmo(m) against the reference's float64 one, on the same (exact) m of one
    block (reference layout):
      * Sign: exact (sign and a power-of-2 divisor);
      * ColNorm, RowNorm, BiasRMS: m / (√(Σ m²)·c + eps), a float32 sum of n squares
        (sum_atol(n, Σm²) relative, halved by the root) and ~5 roundings (the root, c, the sum with
        eps, the division, the product) relative to the result; n the longest such sum;
      * Spectral: newton_schulz_atol (two float32 runs; one against float64 errs less) of the
        Newton–Schulz output, times the √(d_out/d_in) factor, plus its 2 roundings."""
    norm = hp.head_norm if group == "head" else hp.embed_norm if group == "embed" else hp.scalar_norm
    scale = np.abs(ref_lmo).max()
    if group == "hidden" or (group == "head" and norm == "spectral"):
        d_out, d_in = m.shape
        factor = math.sqrt(d_out / d_in)
        return newton_schulz_atol(hp.ns_steps, max(m.shape), ref_lmo / factor) * factor + rounding_rtol(2) * scale
    if norm in ("sign", "none"):
        return 0.0
    return (sum_atol(max(m.shape), 1.0) / 2 + rounding_rtol(5)) * scale


CASES = {  # id: (Scion knobs, decay_embeddings)
    "defaults": ({}, False),  # constrained hidden and head; the embeddings and scalars unconstrained
    "col-spectral": ({"embed_norm": "col", "head_norm": "spectral",
                           "weight_decay": 0.0}, False),  # unconstrained Scion
    "row-none-decayed": ({"embed_norm": "row", "scalar_norm": "none", "weight_decay": 0.5,
                          "scale": 3.0, "embed_scale": 1.0, "head_scale": 10.0}, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scion_matches_pytorch_optimizer_scion(monkeypatch, case):
    knobs, decay_embeddings = CASES[case]
    hp = Scion(momentum=MOMENTUM, decay_embeddings=decay_embeddings, **knobs)
    float64_ns = _float64_newton_schulz()
    monkeypatch.setattr(scion_module, "zero_power_via_newton_schulz_5", float64_ns)
    rng = np.random.default_rng(3)
    params = {k: rng.normal(size=s).astype(np.float32) for k, (s, _) in SHAPES.items()}
    grads = [{k: rng.integers(-64, 65, size=s).astype(np.float32) for k, (s, _) in SHAPES.items()}
             for _ in range(STEPS)]
    labels = {k: g for k, (_, g) in SHAPES.items()}
    schedule = cosine()
    tx = make_optimizer(hp, schedule, labels, None, BASE_LR, OVERRIDES)

    @jax.jit
    def step(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    tensors = {k: [torch.tensor(b, dtype=torch.float64) for b in _blocks(k, params[k])] for k in SHAPES}
    groups = []
    for g in ("hidden", "embed", "head", "scalar"):
        ghp = group_hparams(hp, g, OVERRIDES)  # the decay each group gets by default
        norm, kwargs = ({"hidden": (LMONorm.SPECTRAL, {"num_steps": hp.ns_steps})} | {
            "embed": EMBED[hp.embed_norm], "head": HEAD[hp.head_norm], "scalar": SCALAR[hp.scalar_norm]})[g]
        constrained = ghp.weight_decay == 1.0
        groups.append({"params": [t for k in SHAPES if labels[k] == g for t in tensors[k]], "group": g,
                       "norm_type": norm, "norm_kwargs": kwargs, "scale": hp.radius(g), "constraint": constrained,
                       "weight_decay": 0.0 if constrained else ghp.weight_decay, "lr": PEAKS[g]})
    opt = pytorch_optimizer.SCION(groups, momentum=1 - MOMENTUM, weight_decouple=True, foreach=False)

    p, state = dict(params), tx.init(params)
    atol = {k: 0.0 for k in SHAPES}
    momenta = {k: [np.zeros_like(b, np.float64) for b in _blocks(k, params[k])] for k in SHAPES}
    for t, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = float(schedule(t)) * PEAKS[group["group"]] / BASE_LR
        for k in SHAPES:
            for tensor, b in zip(tensors[k], _blocks(k, g[k]), strict=True):
                tensor.grad = torch.tensor(b, dtype=torch.float64)
        before = {k: [x.numpy().copy() for x in tensors[k]] for k in SHAPES}
        opt.step()
        p, state = step(p, state, g)
        for group in opt.param_groups:
            gname, lr, rho = group["group"], group["lr"], group["scale"]
            wd = group_hparams(hp, gname, OVERRIDES).weight_decay
            for k in (k for k in SHAPES if labels[k] == gname):
                for i, b in enumerate(_blocks(k, g[k])):
                    m = momenta[k][i] = MOMENTUM * momenta[k][i] + (1 - MOMENTUM) * b
                    if gname == "hidden" or (gname == "head" and hp.head_norm == "spectral"):
                        assert np.linalg.norm(m) >= 10  # the eps placements differ by < 1e-8 of X
                    ref_lmo = (before[k][i] * (1 - lr * wd) - tensors[k][i].numpy()) / (lr * rho)
                    # The step's own roundings: the lr (float32 schedule), ρ·lmo, + wd·p, × −lr and
                    # p + u, each <= EPS32/2 of what it rounds: 2·EPS32·(|p| + lr·(ρ|lmo| + wd|p|)), 2x margin.
                    p_max = np.abs(before[k][i]).max()
                    rounding = 4 * EPS32 * (p_max + lr * (rho * np.abs(ref_lmo).max() + wd * p_max))
                    atol[k] += lr * rho * 2 * _lmo_atol(hp, gname, m, ref_lmo) + rounding
            for k in (k for k in SHAPES if labels[k] == gname):
                want = np.stack([x.numpy() for x in tensors[k]]) if len(tensors[k]) > 1 else tensors[k][0].numpy()
                got = np.asarray(p[k], np.float64)
                got = np.stack(_blocks(k, got)) if len(tensors[k]) > 1 else _blocks(k, got)[0]
                np.testing.assert_allclose(got, want, rtol=0, atol=atol[k], err_msg=f"{case} {k} step {t + 1}")
    for k in SHAPES:  # the weights moved far beyond the tolerance: the comparison says something
        moved = max(np.abs(x.numpy() - b).max() for x, b in zip(tensors[k], _blocks(k, params[k]), strict=True))
        assert moved > 100 * atol[k], (case, k, moved, atol[k])
