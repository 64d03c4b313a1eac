"""Parity tier: Sophia-H (optimizer/sophia.py) against its two references.

1. optax.contrib.sophia, whose pieces ours is built from, with one parameter group: the same
   objective, the same Hutchinson probes (ours is handed z ⊙ (H z) made from optax's own key
   sequence, as its hutchinson_estimator_diag_hessian would draw them), and the same schedule:
   the weights must agree bit for bit, step after step. What this pins down is our plumbing: the
   group masking, the estimate read on the steps `hessian_due` says, the clip count kept beside it.
2. pytorch_optimizer 4.1's SophiaH, stepped beside ours on the same weights (ours) and gradients,
   both given the same Hessian estimate: the exact diagonal H of a diagonal quadratic
   ½·Σ H_i (θ_i − c_i)². Aligned where the two are not the same computation:
     * SophiaH has no gamma: update = clip(m / max(h, eps), ±p). It is handed γ·H, so its h is γ
       times ours and its denominator is ours; p = our clip_threshold;
     * SophiaH folds an estimate in before the update of the step it is passed at; optax after
       (optimizer/sophia.py): it is passed the estimate ours read one step later (and zeros on its
       first step, where it would otherwise make its own);
     * SophiaH leaves its momentum without bias correction, optax corrects it: the weights are
       compared at b1 = 0 (m = g on both sides), and at the default b1 the momentum and the
       Hessian EMA themselves (ours corrects only when dividing).
   Neither is bit-identical (torch's EMA is a lerp), so each comparison has a float32 bound derived
   on its line.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import EPS32

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason=REASON)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from optax.contrib import SophiaState  # noqa: E402

from optimizer import make_optimizer  # noqa: E402
from optimizer.diagnostics import find_states  # noqa: E402
from optimizer.sophia import Sophia, SophiaClipState  # noqa: E402

SCHEDULE = optax.linear_schedule(2e-3, 1e-2, 4)  # a warmup: the lr each side uses at each step shows


def objective(p):
    """A small non-quadratic loss with off-diagonal curvature (the Hutchinson noise is real)."""
    return (jnp.sum(jnp.sin(p["w"]) * p["w"] ** 2) + jnp.sum(p["v"] ** 4) / 4
            + 0.1 * jnp.sum(p["w"]) * jnp.sum(p["v"]))


@pytest.mark.slow  # ~2-3 s: two optimizers' steps compiled
def test_one_group_equals_optax_contrib_sophia():
    hp = Sophia(precondition_every=3, weight_decay=0.1, gamma=0.05)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
              "v": jnp.asarray(rng.normal(size=(7,)), jnp.float32)}
    labels = {"w": "hidden", "v": "hidden"}  # one group: the others built empty, as a tied head's is
    ours = make_optimizer(hp, SCHEDULE, labels, None)
    ref = optax.contrib.sophia(SCHEDULE, b1=hp.b1, b2=hp.b2, eps=hp.eps, weight_decay=hp.weight_decay, gamma=hp.gamma,
                               clip_threshold=hp.clip_threshold, update_interval=hp.precondition_every,
                               hessian_diagonal_fn=optax.contrib.hutchinson_estimator_diag_hessian(jax.random.PRNGKey(7)))

    @jax.jit
    def step_ref(p, s):
        u, s = ref.update(jax.grad(objective)(p), s, p, obj_fn=objective)
        return optax.apply_updates(p, u), s

    @jax.jit
    def step_ours(p, s, key):
        # optax's hutchinson_estimator_diag_hessian, drawn from the same key sequence
        key, sub = jax.random.split(key)
        z = optax.tree.random_like(sub, p, jax.random.rademacher, dtype=jnp.float32)
        h = jax.tree.map(lambda a, b: a * b, jax.jvp(jax.grad(objective), (p,), (z,))[1], z)
        u, s = ours.update(jax.grad(objective)(p), s, p, hessian_diag=h)
        return optax.apply_updates(p, u), s, key

    p_ref, s_ref = params, ref.init(params)
    p_ours, s_ours, key = params, ours.init(params), jax.random.PRNGKey(7)
    for t in range(10):  # refreshes at steps 0, 3, 6, 9
        due = bool(hp.hessian_due(s_ours))
        assert due == (t % 3 == 0)
        p_ref, s_ref = step_ref(p_ref, s_ref)
        p_ours, s_ours, new_key = step_ours(p_ours, s_ours, key)
        key = new_key if due else key  # optax's estimator splits its key only when it is called
        for k in params:
            np.testing.assert_array_equal(np.asarray(p_ours[k]), np.asarray(p_ref[k]), err_msg=f"step {t}, {k}")
    nu_ref = find_states(s_ref, SophiaState)[0].nu
    for k in params:  # the Hessian EMA too (ours: the hidden group's state; the other groups mask it)
        np.testing.assert_array_equal(_leaf(find_states(s_ours, SophiaState), "nu", k), np.asarray(nu_ref[k]))


SHAPES = {"w": ((6, 8), "hidden"), "b": ((8,), "scalar")}  # two groups: w decays, b does not


def _torch_pair(hp: Sophia, params):
    tparams = {k: torch.nn.Parameter(torch.tensor(np.asarray(v))) for k, v in params.items()}
    groups = [{"params": [tparams[k]], "weight_decay": hp.weight_decay if label == "hidden" else 0.0}
              for k, (_, label) in SHAPES.items()]
    # update_period: SophiaH makes its own estimate only on its first step (handed zeros there)
    opt = pytorch_optimizer.SophiaH(groups, lr=1.0, betas=(hp.b1, hp.b2), p=hp.clip_threshold, eps=hp.eps,
                                    update_period=10**9, weight_decouple=True, fixed_decay=False, foreach=False)
    return tparams, opt


def _leaf(states, field: str, k: str) -> np.ndarray:
    """Leaf `k` of `field` (mu or nu) from the group state that holds it (the others mask it)."""
    found = [getattr(s, field)[k] for s in states if not isinstance(getattr(s, field)[k], optax.MaskedNode)]
    return np.asarray(found[0])


def _run(hp: Sophia, steps: int):
    """Ours and SophiaH on the quadratic, the gradient taken at our weights and handed to both; per
    step: (ours' params, mu, the nu the update divided by, the coordinates it clipped; torch's
    params, momentum, hessian_moment)."""
    rng = np.random.default_rng(1)
    params = {k: rng.normal(size=shape).astype(np.float32) for k, (shape, _) in SHAPES.items()}
    centre = {k: rng.normal(size=shape).astype(np.float32) for k, (shape, _) in SHAPES.items()}
    hess = {k: rng.uniform(0.5, 2.0, size=shape).astype(np.float32) for k, (shape, _) in SHAPES.items()}
    labels = {k: label for k, (_, label) in SHAPES.items()}
    ours = make_optimizer(hp, SCHEDULE, labels, None)
    update = jax.jit(lambda g, s, p: ours.update(g, s, p, hessian_diag=hess))
    tparams, opt = _torch_pair(hp, params)
    state, p, out, estimate_seen = ours.init(params), dict(params), [], None
    for t in range(steps):
        due = bool(hp.hessian_due(state))
        nu = {k: _leaf(find_states(state, SophiaState), "nu", k) for k in p}
        g = {k: (hess[k].astype(np.float64) * (p[k] - centre[k])).astype(np.float32) for k in p}
        u, state = update(g, state, p)
        p = {k: np.asarray(optax.apply_updates(p[k], u[k])) for k in p}
        for group in opt.param_groups:
            group["lr"] = float(SCHEDULE(t))  # a float32 value: the same lr on both sides
        for k in tparams:
            tparams[k].grad = torch.tensor(g[k])
        opt.step(hessian=[torch.zeros(tparams[k].shape) for k in tparams] if t == 0 else estimate_seen)
        estimate_seen = [torch.tensor(np.float32(hp.gamma) * hess[k]) for k in tparams] if due else None
        clipped = sum(int(s.clipped) for s in find_states(state, SophiaClipState))
        out.append((dict(p), {k: _leaf(find_states(state, SophiaState), "mu", k) for k in p}, nu, clipped,
                    {k: tparams[k].detach().numpy().copy() for k in tparams},
                    {k: opt.state[tparams[k]]["momentum"].numpy().copy() for k in tparams},
                    {k: opt.state[tparams[k]]["hessian_moment"].numpy().copy() for k in tparams}))
    return out


@pytest.mark.slow  # ~3 s: 12 steps beside torch
def test_weights_match_pytorch_optimizer_sophiah_at_b1_zero():
    # gamma 0.5, b2 0.5: γh ~ H/4..H/2 from the first refresh on, so |g/(γh)| ~ 2-4|θ − c| straddles the
    # clip at 1: clipped and unclipped coordinates are both compared (asserted below).
    hp = Sophia(b1=0.0, b2=0.5, gamma=0.5, precondition_every=4, weight_decay=0.1)
    steps = 12
    out = _run(hp, steps)
    refreshes = len(range(0, steps, hp.precondition_every))
    # Denominator: each side's h is an EMA of a constant positive estimate (γH handed to torch, H to
    # ours then times γ), every term positive, nothing cancels: per refresh <= 4 roundings (torch's
    # lerp: difference, product, sum, and γH itself; optax: two products, a sum, and the product by
    # γ), each EPS32/2 relative, older ones only shrinking (times b2): <= 4R·EPS32/2 a side. u = g/den
    # one more a side; the clip is 1-Lipschitz and past it |u| <= clip·(1 + rel):
    # |Δu| <= rel·clip·(1 + rel), rel = 2·(4R + 1)·EPS32/2.
    rel = 2 * (4 * refreshes + 1) * EPS32 / 2
    atol = 0.0  # the weights' bound, summed over the steps below (each step's term derived there)
    for t, (p, _, _, _, tp, _, _) in enumerate(out):
        lr = float(SCHEDULE(t))
        scale = max(np.abs(x).max() for x in p.values())
        # Per step: lr·|Δu| from the direction, plus the weight update's own roundings: ours
        # p + (−lr·(u + wd·p)) 4 (wd·p, the sum, ·lr, p +), torch's p·(1 − lr·wd) − lr·u 4 (1 − lr·wd,
        # the product, lr·u, the sum), each <= EPS32/2 of (|p| + lr·clip). Earlier steps' errors carry
        # over unchanged (the gradient is ours, handed to both): the bounds add. Margin 2.
        atol += 2 * (lr * rel * hp.clip_threshold * (1 + rel) + 8 * EPS32 / 2 * (scale + lr * hp.clip_threshold))
        for k in p:
            np.testing.assert_allclose(tp[k], p[k], rtol=0, atol=atol, err_msg=f"step {t}, {k}")
    size = sum(np.prod(shape) for shape, _ in SHAPES.values())
    clipped = [c for *_, c, _, _, _ in out[1:]]
    assert 0 < sum(clipped) < size * (steps - 1), clipped  # both kinds of coordinates were compared


def test_momentum_and_hessian_ema_match_pytorch_optimizer_sophiah():
    """At the default b1 the two updates differ by the bias correction (module docstring); the
    states they divide do not: our mu is SophiaH's momentum, γ times the h our update at step t divided
    by is the hessian_moment SophiaH's update at step t divided by."""
    hp = Sophia(precondition_every=3)
    out = _run(hp, 9)
    g_scale = 0.0
    for t, (_, mu, nu, _, _, momentum, hm) in enumerate(out):
        for k in mu:
            g_scale = max(g_scale, np.abs(mu[k]).max() / (1 - hp.b1), np.abs(momentum[k]).max() / (1 - hp.b1))
            # m ← b1·m + (1 − b1)·g against m + (1 − b1)·(g − m): 3 roundings a side per step, each
            # <= EPS32/2 of max(|m|, |g|) (|g| <= max|m|/(1 − b1) over the steps, g_scale), earlier
            # errors shrinking by b1: over t + 1 steps <= 2·3·(t + 1)·EPS32/2·g_scale. Margin 2.
            np.testing.assert_allclose(mu[k], momentum[k], rtol=0, atol=2 * 6 * (t + 1) * EPS32 / 2 * g_scale,
                                       err_msg=f"momentum, step {t}, {k}")
            # positive EMAs of a constant estimate: <= 4 roundings a refresh a side (the first test),
            # plus γ·nu here: rtol 2·(4R + 1)·EPS32/2, R the refreshes so far. Margin 2.
            refreshes = len(range(0, t, hp.precondition_every))
            np.testing.assert_allclose(np.float32(hp.gamma) * nu[k], hm[k], atol=0,
                                       rtol=2 * 2 * (4 * refreshes + 1) * EPS32 / 2, err_msg=f"h, step {t}, {k}")
    assert all(np.all(out[-1][6][k] > 0) for k in SHAPES)  # the estimates did reach both
