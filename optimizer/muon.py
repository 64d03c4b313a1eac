"""Muon: Newton–Schulz-orthogonalised momentum for the block matrices, AdamW for the rest.

Block weights are stacked (num_blocks, d_in, d_out) for lax.scan, and MoE models stack more:
experts (num_blocks, E, d_in, d_out), grouped dense blocks (G, every-1, d_in, d_out) (models/moe.py).
Muon must orthogonalise each d_in×d_out matrix on its own, so the dimension numbers name the
second-to-last axis as the reduction axis and the last as the output axis, leaving every leading
axis a batch axis. (optax.contrib.muon's default would treat every 2-D leaf as a matrix,
embeddings included, and send 3-D leaves to AdamW; fixed axes (1, 2) would mix a 4-D leaf's
experts into one matrix.)

An orthogonalised m×n update has RMS 1/√max(m, n), so its size depends on the matrix's shape;
`shape_scale` picks the convention that fixes it (per block, fan_in = d_in, fan_out = d_out):
  * `reference`: ×√max(1, fan_out/fan_in), as Keller Jordan's Muon and optax.contrib.muon do
    (scale_by_muon alone leaves it out: wide matrices such as attn_qkv and mlp_in would step
    1/√3 and 1/2 as far as the reference at the same lr);
  * `adam_rms`: ×0.2·√max(fan_in, fan_out), an update RMS of 0.2·lr whatever the shape, like
    AdamW's, so AdamW's lr and weight decay carry over (Moonlight, "Muon is Scalable for LLM
    Training", arXiv:2502.16982; optax.contrib.muon(consistent_rms=0.2)).

`ns_coefficients` picks the Newton–Schulz polynomial. `quintic` (default): Keller Jordan's one
(a, b, c) = (3.4445, −4.7750, 2.0315) every iteration, which leaves singular values anywhere in
about [0.68, 1.2] however many iterations run. `polar_express`: Polar Express (Amsel, Persson,
Musco, Gower 2025, "The Polar Express: Optimal Matrix Sign Methods and Their Application to the
Muon Algorithm", arXiv:2505.16932), one minimax-optimal (a_t, b_t, c_t) per iteration for singular
values in [1e-3, 1], so the same ns_steps lands them closer to 1 (5 steps: within [0.84, 1.13]).
Both run in optax's scale_by_muon; Polar Express as a (ns_steps, 3) table (`polar_express_coefficients`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon

from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v, array_leaves, find_states, is_masked
from optimizer.groups import check_non_negative, check_unit_interval
from utils.errors import ConfigError

STACKED_MATRIX = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)  # every leading axis: a batch axis
SHAPE_SCALES = ("reference", "adam_rms")
ADAM_RMS = 0.2  # the update RMS (per unit lr) of `adam_rms`: what AdamW's updates typically have
NS_COEFFICIENTS = ("quintic", "polar_express")
QUINTIC_EPS = 1e-8  # scale_by_muon's default: X / (‖X‖_F + eps) before the quintic iterations

# Polar Express's (a_t, b_t, c_t), iteration t applying X <- a_t X + b_t (X Xᵀ) X + c_t (X Xᵀ)² X: the
# coefficients the authors publish for arXiv:2505.16932 in github.com/NoahAmsel/PolarExpress,
# polar_express/basic.py, computed by their optimal_composition(l=1e-3, num_iters=8,
# safety_factor_eps=1e-2, cushion=0.02) and listed before the safety factor. The last is the limit
# the sequence reaches, (15/8, −10/8, 3/8); the authors repeat it past 8 steps, when singular values in
# [1e-3, 1] are already 1 to float32's precision, so ns_steps is refused above 8 instead.
POLAR_EXPRESS_ABC = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The authors' safety factor s: each polynomial but the last takes x/s (a/s, b/s³, c/s⁵), so rounding
# that pushes a singular value just above the interval it was designed for cannot blow up; and their
# input normalisation X / (s·‖X‖_F + POLAR_EXPRESS_EPS), a spectral norm at most 1/s.
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS_EPS = 1e-7


def polar_express_coefficients(ns_steps: int) -> np.ndarray:
    """(ns_steps, 3) float64: the first ns_steps Polar Express triples as scale_by_muon applies them
    after its own normalisation X / (‖X‖_F + eps) with eps = POLAR_EXPRESS_EPS / s. That is the
    authors' X / (s·‖X‖_F + POLAR_EXPRESS_EPS) times s, so the first polynomial takes one more
    factor 1/s, folded into its coefficients as the safety factor is: the same map in exact
    arithmetic (tests/test_polar_express.py checks it against the authors' order in float64)."""
    s = POLAR_EXPRESS_SAFETY
    last = len(POLAR_EXPRESS_ABC) - 1
    abc = np.array([(a / s, b / s**3, c / s**5) if t < last else (a, b, c)
                    for t, (a, b, c) in enumerate(POLAR_EXPRESS_ABC)], np.float64)[:ns_steps]
    abc[0] /= (s, s**3, s**5)  # the normalisation's 1/s
    return abc


def _stacked_dims(updates):
    return jax.tree.map(lambda _: STACKED_MATRIX, updates)


def shape_factor(shape: tuple[int, ...], convention: str) -> float:
    """The factor `convention` multiplies the orthogonalised update of a stack of matrices by."""
    fan_in, fan_out = shape[STACKED_MATRIX.reduction_axis], shape[STACKED_MATRIX.output_axis]
    if convention == "adam_rms":
        return ADAM_RMS * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_shape(convention: str) -> optax.GradientTransformation:
    """Each leaf times its `shape_factor`: a Python float fixed by the static shape."""

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u * shape_factor(u.shape, convention), updates), state

    return optax.GradientTransformation(lambda _params: optax.EmptyState(), update_fn)


def newton_schulz(mu: jax.Array, ns_coeffs: jax.Array, ns_steps: int, eps: float) -> jax.Array:
    """The Newton–Schulz output scale_by_muon computes from momentum `mu` (a stack of blocks), with
    optax's public API only (its `orthogonalize_via_newton_schulz` is not re-exported): a fresh
    scale_by_muon with beta 0 and no Nesterov is exactly that pass (its momentum 1·mu + 0·0 and bias
    correction /(1 − 0¹) are exact), with the same coefficients (a (3,) triple or an (ns_steps, 3)
    table), Frobenius pre-scaling and eps (Muon.newton_schulz_args')."""
    ns = scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=0.0, nesterov=False, eps=eps,
                       weight_dimension_numbers=_stacked_dims)
    return ns.update(mu, ns.init(mu))[0]


def nesterov_input(mu: jax.Array, g: jax.Array, count: jax.Array, beta: float) -> jax.Array:
    """What scale_by_muon(nesterov=True) hands Newton–Schulz, from the state it left (momentum `mu`,
    `count` already incremented) and the gradient `g` it took: β·mu/(1 − β^(count+1)) +
    (1 − β)·g/(1 − β^count), optax 0.2's bias corrections as they are."""
    bc = lambda x, t: x / (1 - beta ** t).astype(x.dtype)  # optax.tree.bias_correction's expression
    return beta * bc(mu, count + 1) + (1 - beta) * bc(g.astype(mu.dtype), count)


def orthogonality_error(o_BxMxN: jax.Array) -> jax.Array:
    """‖G − I‖_F / √k per matrix of a stack, G = O Oᵀ when m <= n else Oᵀ O (the k×k Gram on
    the smaller side, k = min(m, n)); equal to √(Σᵢ(σᵢ² − 1)²/k), the RMS of σ² − 1 over O's k
    singular values: 0 when O is orthogonal (on its short side), 1 when O = 0."""
    o = o_BxMxN.astype(jnp.float32)
    m, n = o.shape[-2:]
    gram_BxKxK = (jnp.matmul(o, jnp.swapaxes(o, -1, -2), precision=jax.lax.Precision.HIGHEST) if m <= n else
                  jnp.matmul(jnp.swapaxes(o, -1, -2), o, precision=jax.lax.Precision.HIGHEST))
    k = min(m, n)
    return jnp.linalg.norm(gram_BxKxK - jnp.eye(k, dtype=jnp.float32), axis=(-2, -1)) / math.sqrt(k)


@dataclass(frozen=True)
class Muon(Optimizer):
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: str = "quintic"  # quintic | polar_express: see the module docstring
    shape_scale: str = "reference"  # reference | adam_rms: see the module docstring
    weight_decay: float = 0.0
    adam_lr: float = 3e-3  # peak lr of the AdamW groups (embed, head, scalar); lr_config.lr is Muon's
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8

    MUON_KNOBS = ("lr", "weight_decay", "momentum")
    ADAM_KNOBS = ("lr", "weight_decay", "adam_b1", "adam_b2", "adam_eps")

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """`hidden` runs Muon (no adam_*), the other groups AdamW (no Muon momentum)."""
        return self.MUON_KNOBS if group == "hidden" else self.ADAM_KNOBS

    def group_knob_hint(self, group: str, knob: str) -> str:
        name = type(self).__name__  # Muon, or NorMuon built on it
        if group == "hidden":
            return f"the hidden group uses {name}, not AdamW; set optimizer.groups.hidden.momentum instead"
        return f"the {group} group uses AdamW under {name}; set optimizer.groups.{group}.adam_b1 instead"

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum", "adam_b1", "adam_b2")
        check_non_negative(prefix, self, "weight_decay")
        if self.ns_steps <= 0:
            raise ConfigError(f"{prefix}.ns_steps={self.ns_steps} must be a positive integer")
        if self.ns_coefficients not in NS_COEFFICIENTS:
            raise ConfigError(f"{prefix}.ns_coefficients={self.ns_coefficients!r} must be one of "
                              f"{', '.join(NS_COEFFICIENTS)}")
        if self.ns_coefficients == "polar_express" and self.ns_steps > len(POLAR_EXPRESS_ABC):
            raise ConfigError(f"{prefix}.ns_steps={self.ns_steps} exceeds the {len(POLAR_EXPRESS_ABC)} published "
                              f"Polar Express iterations of {prefix}.ns_coefficients=polar_express: set "
                              f"{prefix}.ns_steps to at most {len(POLAR_EXPRESS_ABC)}")
        if self.shape_scale not in SHAPE_SCALES:
            raise ConfigError(f"{prefix}.shape_scale={self.shape_scale!r} must be one of {', '.join(SHAPE_SCALES)}")
        if self.adam_lr <= 0 or self.adam_eps <= 0:
            raise ConfigError(f"{prefix}.adam_lr and {prefix}.adam_eps must be positive")

    def default_group_lr(self, group: str, base_lr: float) -> float:
        return base_lr if group == "hidden" else self.adam_lr

    @property
    def MUP_HIDDEN_LR_POWER(self) -> float:
        """model.mup (optimizer/mup.py): `reference`'s orthogonalised step has spectral norm Θ(lr)·√max(1,
        fan_out/fan_in), width-invariant at a fixed aspect ratio (0: the lr transfers as it is); `adam_rms`'s
        0.2·√max(fan_in, fan_out) grows ∝ √width, so lr x (base/width)^½ restores it."""
        return 0.0 if self.shape_scale == "reference" else 0.5

    def newton_schulz_args(self) -> dict:
        """scale_by_muon's Newton–Schulz arguments for `ns_coefficients`: quintic's are optax's
        defaults (its coefficients, eps 1e-8), so its updates are what they always were."""
        if self.ns_coefficients == "quintic":
            return {"ns_steps": self.ns_steps, "eps": QUINTIC_EPS}
        return {"ns_steps": self.ns_steps, "ns_coeffs": tuple(map(tuple, polar_express_coefficients(self.ns_steps))),
                "eps": POLAR_EXPRESS_EPS / POLAR_EXPRESS_SAFETY}

    def orthogonalise(self) -> optax.GradientTransformation:
        """Momentum, Nesterov and Newton–Schulz per block of each stacked leaf (optax's scale_by_muon)."""
        return scale_by_muon(beta=self.momentum, nesterov=self.nesterov, weight_dimension_numbers=_stacked_dims,
                             **self.newton_schulz_args())

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if group != "hidden":
            return optax.adamw(schedule, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                               weight_decay=self.weight_decay)
        return optax.chain(
            self.orthogonalise(),
            scale_by_shape(self.shape_scale),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params, grads=None) -> dict:
        """hidden: ortho_err_mean / ortho_err_max, the `orthogonality_error` of the Newton–Schulz
        output recomputed from what the update orthogonalised (the same ns_steps, coefficients and
        Frobenius pre-scaling), over every block of every hidden leaf; costs one more Newton–Schulz
        pass. That is the momentum in the state, or with `nesterov` its blend with the step's
        gradient (`grads`, clipped as the update saw it; `nesterov_input`); without `grads` (a
        caller holding only the state) the momentum alone, which the blend is close to but not the
        same as. A skipped non-finite step's gradient gives NaN (it took no update).
        Other groups (AdamW): sqrt_v_min / _median / _max."""
        if group != "hidden":
            return adam_sqrt_v(group_state, self.adam_b2)
        states = find_states(group_state, MuonState)
        mus = array_leaves(states[0].mu) if states else []
        if not mus:
            return {}
        if self.nesterov and grads is not None:
            gs = []  # the group's gradient leaves, lined up with its momentum (MaskedNode elsewhere)
            jax.tree.map(lambda m, g: None if is_masked(m) else gs.append(g), states[0].mu, grads, is_leaf=is_masked)
            mus = [nesterov_input(mu, g, states[0].count, self.momentum) for mu, g in zip(mus, gs)]
        errs = jnp.concatenate([
            orthogonality_error(newton_schulz(mu, states[0].ns_coeffs, self.ns_steps,
                                              self.newton_schulz_args()["eps"])).reshape(-1)
            for mu in mus])
        return {"ortho_err_mean": jnp.mean(errs), "ortho_err_max": jnp.max(errs)}
