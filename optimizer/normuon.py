"""NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491):
Muon whose orthogonalised update is then normalised per neuron by an Adam-like second moment.

Muon's Newton–Schulz output O has (nearly) equal singular values but its rows can still differ
widely in norm, so some neurons take much larger steps than others. NorMuon keeps, per output
neuron j of each d_in×d_out block, an EMA of the mean square of its column of O,
v_j ← beta2·v_j + (1 − beta2)·mean_i O_ij², divides the column by √v_j + eps, and rescales the
block to a fixed Frobenius norm (per block of the stacked weights, as Muon orthogonalises):
  * shape_scale=reference: O's own norm (the authors' code: ‖Ô‖ = ‖O‖), then Muon's reference
    factor √max(1, d_out/d_in);
  * shape_scale=adam_rms: 0.2·√(d_in·d_out), an update RMS of exactly 0.2·lr (the paper's
    Algorithm 1), so AdamW's lr and weight decay carry over.
(The output neuron is the last axis here: weights are stored d_in×d_out, where PyTorch's are
out×in and the authors take the mean along a row.) v starts at 0 with no bias correction, as the
authors'; the block's rescaling removes the common factor it would have been.

Everything else is Muon's (optimizer/muon.py): the same momentum, Nesterov, Newton–Schulz on each
block of a stack, decoupled weight decay times the lr, AdamW on the embed, head and scalar groups
at `adam_lr`, and `ns_coefficients` (quintic, or Polar Express's per-iteration polynomials). The
state adds v: one float32 per output neuron per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.diagnostics import array_leaves, find_states
from optimizer.groups import check_positive, check_unit_interval
from optimizer.muon import ADAM_RMS, STACKED_MATRIX, Muon, scale_by_shape


class NeuronNormState(NamedTuple):
    # per leaf (..., d_out), the parameter without its d_in axis (laid out as the parameter's other
    # axes are: utils/parallel/layout.py's factored case): each output neuron's EMA of its mean
    # squared orthogonalised update
    v: Any


def neuron_normalise(o: jax.Array, v: jax.Array, beta2: float, eps: float,
                     shape_scale: str) -> tuple[jax.Array, jax.Array]:
    """(the normalised and rescaled update, the new v) of one stack of orthogonalised blocks `o`
    (..., d_in, d_out) with neuron second moments `v` (..., d_out), in float32."""
    o32 = o.astype(jnp.float32)
    reduce_axis, out_axis = STACKED_MATRIX.reduction_axis, STACKED_MATRIX.output_axis
    v = beta2 * v + (1 - beta2) * jnp.mean(jnp.square(o32), axis=reduce_axis)
    normalised = o32 / (jnp.expand_dims(jnp.sqrt(v), reduce_axis) + eps)
    frobenius = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=(reduce_axis, out_axis), keepdims=True))
    if shape_scale == "adam_rms":
        target = ADAM_RMS * math.sqrt(o.shape[reduce_axis] * o.shape[out_axis])
    else:
        target = frobenius(o32)
    return (normalised * (target / (frobenius(normalised) + eps))).astype(o.dtype), v


def scale_by_neuron_norm(beta2: float, eps: float, shape_scale: str) -> optax.GradientTransformation:
    """NorMuon's stage after Newton–Schulz (see the module docstring), on every leaf of the group."""

    def init_fn(params):
        return NeuronNormState(v=jax.tree.map(lambda p: jnp.zeros((*p.shape[:-2], p.shape[-1]), jnp.float32), params))

    def update_fn(updates, state, params=None):
        del params
        flat, treedef = jax.tree.flatten(updates)
        pairs = [neuron_normalise(o, v, beta2, eps, shape_scale) for o, v in zip(flat, treedef.flatten_up_to(state.v))]
        return treedef.unflatten([u for u, _ in pairs]), NeuronNormState(v=treedef.unflatten([v for _, v in pairs]))

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class NorMuon(Muon):
    b2: float = 0.95  # the neurons' second moment (scale_by_neuron_norm's beta2)
    eps: float = 1e-10

    MUON_KNOBS = ("lr", "weight_decay", "momentum", "b2")

    def check(self, prefix: str) -> None:
        super().check(prefix)
        check_unit_interval(prefix, self, "b2")
        check_positive(prefix, self, "eps")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if group != "hidden":
            return super().transform(group, schedule)
        return optax.chain(
            self.orthogonalise(),
            scale_by_neuron_norm(self.b2, self.eps, self.shape_scale),
            scale_by_shape("reference") if self.shape_scale == "reference" else optax.identity(),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params, grads=None) -> dict:
        """hidden: Muon's ortho_err_mean / _max (of the Newton–Schulz output, before the neuron
        normalisation), and neuron_spread_mean / _max: per block, the largest √v_j over the
        smallest, how unequal the neurons' update sizes were that NorMuon evens out (1 before the
        first update; v's missing bias correction cancels in the ratio). Other groups: AdamW's."""
        out = super().diagnostics(group, group_state, params, grads=grads)
        states = find_states(group_state, NeuronNormState) if group == "hidden" else []
        vs = array_leaves(states[0].v) if states else []
        if not vs:
            return out
        spreads = []
        for v in vs:
            root = jnp.sqrt(v.reshape(-1, v.shape[-1]))  # (blocks, d_out)
            high, low = jnp.max(root, axis=-1), jnp.min(root, axis=-1)
            spreads.append(jnp.where(high > 0, high / low, 1.0))
        spread = jnp.concatenate(spreads)
        return {**out, "neuron_spread_mean": jnp.mean(spread), "neuron_spread_max": jnp.max(spread)}
