"""Scion's parts the parity test (tests/test_parity_scion.py) cannot reach through the reference:
the scalars' `sign` LMO and a 0-d scalar's BiasRMS (the authors' Sign and BiasRMS take matrices
and vectors), the diagnostics, and the knobs' refusals. Float64 NumPy re-derivations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rounding_rtol, sum_atol

from optimizer.scion import LMO_EPS, Scion
from utils.errors import ConfigError


def _updates(tx, params, grads_seq):
    """(the updates as NumPy, the states after each) of `tx` stepped on `grads_seq` at fixed `params`."""
    state, update, outs, states = tx.init(params), jax.jit(tx.update), [], []
    for g in grads_seq:
        u, state = update(g, state, params)
        outs.append(jax.tree.map(np.asarray, u))
        states.append(state)
    return outs, states


def test_scalar_sign_and_zero_d_bias_rms_against_numpy():
    """sign: sign(m)·ρ, unnormalised (a vector has no fan_in); bias_rms of a 0-d scalar: m/(|m| + eps),
    its own vector. Two updates at momentum 0.5 (exact in float32 for these gradients) at lr 1."""
    rho = 3.0
    grads = [{"b": jnp.asarray([1.5, -2.0, 0.25], jnp.float32), "g": jnp.asarray(-0.75, jnp.float32)},
             {"b": jnp.asarray([-4.0, 1.0, 0.5], jnp.float32), "g": jnp.asarray(2.0, jnp.float32)}]
    for norm in ("sign", "bias_rms"):
        tx = Scion(momentum=0.5, weight_decay=0.0, scalar_scale=rho, scalar_norm=norm).transform(
            "scalar", optax.constant_schedule(1.0))
        outs, _ = _updates(tx, jax.tree.map(jnp.zeros_like, grads[0]), grads)
        m = {k: np.zeros(np.shape(v)) for k, v in grads[0].items()}
        for g, u in zip(grads, outs, strict=True):
            for k in g:
                m[k] = 0.5 * m[k] + 0.5 * np.asarray(g[k], np.float64)
                if norm == "sign":
                    want = -rho * np.sign(m[k])
                    np.testing.assert_array_equal(u[k], want)  # sign and a product by 3: exact
                elif k == "g":
                    # m/(|m| + eps)·ρ·(−1): 3 roundings (abs is exact), 2x margin
                    np.testing.assert_allclose(u[k], -rho * m[k] / (abs(m[k]) + LMO_EPS), rtol=rounding_rtol(3))


def test_diagnostics_match_numpy():
    """momentum_rms: RMS of m over the group's leaves; update_rms: of ρ·lmo(m) (embed `col`: each row
    to RMS 1). Float32 sums of n squares: sum_atol(n) relative, halved by
    the root, and ~4 roundings (the quotient, the root, the row normalisation's)."""
    rng = np.random.default_rng(0)
    draw = lambda: {"e": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
                    "p": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)}
    params, grads = draw(), [draw(), draw()]
    hp = Scion(momentum=0.9, embed_norm="col", embed_scale=7.0)
    _, states = _updates(hp.transform("embed", optax.constant_schedule(0.1)), params, grads)
    stats = {k: float(v) for k, v in hp.diagnostics("embed", states[-1], params).items()}
    g64 = [{k: np.asarray(v, np.float64) for k, v in g.items()} for g in grads]
    m = {k: 0.9 * (0.1 * g64[0][k]) + 0.1 * g64[1][k] for k in params}
    n = sum(x.size for x in m.values())
    momentum_rms = np.sqrt(sum(np.sum(x**2) for x in m.values()) / n)
    lmo = [x / (np.sqrt(np.mean(x**2, axis=-1, keepdims=True)) + LMO_EPS) for x in m.values()]
    update_rms = 7.0 * np.sqrt(sum(np.sum(x**2) for x in lmo) / n)
    rtol = sum_atol(n, 1.0) / 2 + rounding_rtol(4)
    assert set(stats) == {"momentum_rms", "update_rms"}
    np.testing.assert_allclose(stats["momentum_rms"], momentum_rms, rtol=rtol)
    np.testing.assert_allclose(stats["update_rms"], update_rms, rtol=rtol + sum_atol(8, 1.0))  # + the rows' sums


@pytest.mark.parametrize("knobs, knob", [({"embed_norm": "spectral"}, "embed_norm"),
                                         ({"head_norm": "col"}, "head_norm"),
                                         ({"scalar_norm": "rms"}, "scalar_norm"),
                                         ({"scale": 0.0}, "scale"), ({"momentum": 1.0}, "momentum"),
                                         ({"ns_coefficients": "polar_express", "ns_steps": 9}, "ns_steps")])
def test_bad_knobs_are_refused_naming_the_knob(knobs, knob):
    with pytest.raises(ConfigError, match=rf"optimizer\.{knob}"):
        Scion(**knobs).check("optimizer")
