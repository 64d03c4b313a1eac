"""Scion (Pethick, Xie, Antonakopoulos, Zhu, Silveti-Falls, Cevher 2025, "Training Deep Learning
Models with Norm-Constrained LMOs", arXiv:2502.07529; the authors' code: github.com/LIONS-EPFL/scion,
scion.py): each group steps along the linear minimisation oracle (LMO) of a norm chosen for what
the group's weights do, applied to a momentum average of the gradients.

Per group, with m the momentum and ρ the group's radius (`scale`, `embed_scale`, ...):
    m ← momentum·m + (1 − momentum)·g          (the authors' `momentum` is 1 − ours: their 0.1 is 0.9 here)
    x ← x − lr·(ρ·lmo(m) + weight_decay·x)
`weight_decay=1` is the authors' constrained Scion, x ← (1 − lr)·x − lr·ρ·lmo(m) (their default
`unconstrained=False`: the iterates stay in the ball of radius ρ), `weight_decay=0` their
unconstrained Scion; it is decoupled decay times the lr, so the cautious mask and muP treat it as
any optimizer's. The LMOs, per block of a stacked leaf (weights stored d_in×d_out, PyTorch's out×in
transposed, so the authors' "column" of an out×in matrix is a row of ours):
  * hidden (and LoRA's factors): Spectral, the Newton–Schulz orthogonalisation of m (Muon's pass,
    optimizer/muon.py) times √(d_out/d_in) (their `normalized=True`, no max with 1, unlike Muon);
  * embed: `sign` (their Sign on the tied embedding/head of nanoGPT: sign(m)/D), `col` (their ColNorm
    with transpose=True of the first layer: each token's vector scaled to RMS 1) or `row` (RowNorm,
    transpose=True, normalized=False: each embedding dimension's vector over the vocabulary to norm 1);
  * head: `sign` (sign(m)/d_in, their nanoGPT head) or `spectral` (as hidden);
  * scalar (biases, norm gains): `bias_rms` (their BiasRMS, the Auto choice for vectors: m over its
    RMS along the vector), `sign` (sign(m)) or `none` (m itself: momentum SGD).
Defaults are the authors' nanoGPT configuration (their README's; examples/modded-nanogpt/
train_gpt_scion.py has the same radii and momentum at lr 3.6e-4): lr 2⁻¹², momentum 0.1 (0.9 here),
constrained, hidden radius 50, head (tied: the embedding) Sign at 50·60 = 3000, five quintic
Newton–Schulz iterations with X/(‖X‖_F + 1e-7); the yaml sets `decay_embeddings: true`, so the
embeddings are constrained too, as the authors constrain every group they step. The scalars'
`sign` is not theirs (their Sign takes matrices only). Not taken from their code: its bfloat16
Newton–Schulz (float32 here, as Muon's) and its `init()`, which re-initialises the weights in each
norm's ball (the model's own initialisation is kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from optimizer.muon import (
    NS_COEFFICIENTS,
    POLAR_EXPRESS_ABC,
    POLAR_EXPRESS_EPS,
    POLAR_EXPRESS_SAFETY,
    STACKED_MATRIX,
    newton_schulz,
    polar_express_coefficients,
)
from utils.errors import ConfigError

# Keller Jordan's quintic (a, b, c), the authors' zeropower_via_newtonschulz5 (and optax's default),
# and their normalisation X / (‖X‖_F + 1e-7) before it.
QUINTIC_ABC = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
LMO_EPS = 1e-8  # the authors' eps added to ColNorm's, RowNorm's and BiasRMS's denominators

EMBED_NORMS = ("sign", "col", "row")
HEAD_NORMS = ("sign", "spectral")
SCALAR_NORMS = ("bias_rms", "sign", "none")
SPECTRAL_GROUPS = ("hidden", "lora")  # the matrices in blocks, and LoRA's factors


def spectral_lmo(m: jax.Array, ns_coeffs, ns_steps: int, eps: float) -> jax.Array:
    """Spectral's LMO of a stack of d_in×d_out blocks: Newton–Schulz times √(d_out/d_in)."""
    d_in, d_out = m.shape[STACKED_MATRIX.reduction_axis], m.shape[STACKED_MATRIX.output_axis]
    return newton_schulz(m, ns_coeffs, ns_steps, eps) * math.sqrt(d_out / d_in)


def sign_lmo(m: jax.Array, fan_in: int) -> jax.Array:
    """Sign's LMO, normalized: sign(m)/fan_in."""
    return jnp.sign(m) / fan_in


def col_norm_lmo(m_VxD: jax.Array) -> jax.Array:
    """ColNorm(transpose=True, normalized=False) of a (.., V, D) embedding: each row to RMS 1."""
    rms = jnp.sqrt(jnp.sum(jnp.square(m_VxD), axis=-1, keepdims=True)) / math.sqrt(m_VxD.shape[-1])
    return m_VxD / (rms + LMO_EPS)


def row_norm_lmo(m_VxD: jax.Array) -> jax.Array:
    """RowNorm(transpose=True, normalized=False) of a (.., V, D) embedding: each column to norm 1."""
    return m_VxD / (jnp.sqrt(jnp.sum(jnp.square(m_VxD), axis=-2, keepdims=True)) + LMO_EPS)


def bias_rms_lmo(m: jax.Array) -> jax.Array:
    """BiasRMS of a vector (or a stack of them, one per block; a 0-d scalar is its own vector): m over
    its RMS along the vector."""
    axis = -1 if m.ndim else None
    return m / (jnp.sqrt(jnp.mean(jnp.square(m), axis=axis, keepdims=True)) + LMO_EPS)


@dataclass(frozen=True)
class Scion(Optimizer):
    momentum: float = 0.9
    weight_decay: float = 1.0  # 1: the authors' constrained Scion; 0: unconstrained
    scale: float = 50.0  # radius of the hidden group (and LoRA's factors)
    embed_scale: float = 3000.0
    head_scale: float = 3000.0
    scalar_scale: float = 1.0
    embed_norm: str = "sign"
    head_norm: str = "sign"
    scalar_norm: str = "bias_rms"
    ns_steps: int = 5
    ns_coefficients: str = "quintic"  # quintic | polar_express: optimizer/muon.py's docstring

    GROUP_KNOBS = ("lr", "weight_decay", "momentum")
    # model.mup (optimizer/mup.py): the Spectral LMO's step has spectral norm lr·ρ·√(d_out/d_in), constant
    # at a fixed aspect ratio whatever the width (the spectral condition; the paper's point is that lr and
    # radii transfer across widths): 0, the lr transfers as it is.
    MUP_HIDDEN_LR_POWER = 0.0

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "scale", "embed_scale", "head_scale", "scalar_scale")
        for knob, choices in (("embed_norm", EMBED_NORMS), ("head_norm", HEAD_NORMS),
                              ("scalar_norm", SCALAR_NORMS), ("ns_coefficients", NS_COEFFICIENTS)):
            if getattr(self, knob) not in choices:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)!r} must be one of {', '.join(choices)}")
        if self.ns_steps <= 0:
            raise ConfigError(f"{prefix}.ns_steps={self.ns_steps} must be a positive integer")
        if self.ns_coefficients == "polar_express" and self.ns_steps > len(POLAR_EXPRESS_ABC):
            raise ConfigError(f"{prefix}.ns_steps={self.ns_steps} exceeds the {len(POLAR_EXPRESS_ABC)} published "
                              f"Polar Express iterations: set {prefix}.ns_steps to at most {len(POLAR_EXPRESS_ABC)}")

    def newton_schulz_args(self) -> tuple:
        """(coefficients, ns_steps, eps) of the Newton–Schulz pass: quintic with the authors' eps, or
        Polar Express's table and normalisation (as Muon's)."""
        if self.ns_coefficients == "quintic":
            return QUINTIC_ABC, self.ns_steps, NS_EPS
        return (tuple(map(tuple, polar_express_coefficients(self.ns_steps))), self.ns_steps,
                POLAR_EXPRESS_EPS / POLAR_EXPRESS_SAFETY)

    def radius(self, group: str):
        """The group's radius ρ."""
        return {"embed": self.embed_scale, "head": self.head_scale, "scalar": self.scalar_scale}.get(group, self.scale)

    def lmo(self, group: str, m: jax.Array) -> jax.Array:
        """The group's LMO of one momentum leaf (radius 1)."""
        if group in SPECTRAL_GROUPS or (group == "head" and self.head_norm == "spectral"):
            return spectral_lmo(m, *self.newton_schulz_args())
        if group == "head":
            return sign_lmo(m, m.shape[STACKED_MATRIX.reduction_axis])  # head_DxV: d_in = D
        if group == "embed":
            if self.embed_norm == "col":
                return col_norm_lmo(m)
            if self.embed_norm == "row":
                return row_norm_lmo(m)
            return sign_lmo(m, m.shape[-1])  # (V, D) as the tied head's out×in: d_in = D
        if self.scalar_norm == "bias_rms":
            return bias_rms_lmo(m)
        return jnp.sign(m) if self.scalar_norm == "sign" else m

    def scale_by_lmo(self, group: str) -> optax.GradientTransformation:
        """Each leaf of the group to ρ·lmo(leaf) (stateless)."""
        rho = self.radius(group)

        def update_fn(updates, state, params=None):
            del params
            step = lambda m: (rho * self.lmo(group, m.astype(jnp.float32))).astype(m.dtype)
            return jax.tree.map(step, updates), state

        return optax.GradientTransformation(lambda _params: optax.EmptyState(), update_fn)

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            optax.ema(self.momentum, debias=False),  # m ← momentum·m + (1 − momentum)·g, from 0
            self.scale_by_lmo(group),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params, grads=None) -> dict:
        """momentum_rms: the RMS of the group's momentum m over all its entries; update_rms: the RMS
        of ρ·lmo(m), the last step before the lr and the decay (recomputed from m: one more
        Newton–Schulz pass on the spectral groups; 0 before the first update)."""
        states = find_states(group_state, optax.EmaState)
        ms = array_leaves(states[0].ema) if states else []
        if not ms:
            return {}
        count = sum(m.size for m in ms)
        rms = lambda xs: jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs) / count)
        update_rms = self.radius(group) * rms([self.lmo(group, m.astype(jnp.float32)) for m in ms])
        return {"momentum_rms": rms(ms), "update_rms": update_rms}
