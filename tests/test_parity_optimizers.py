"""Parity tier: SOAP, MARS and Kron against their PyTorch references, same gradients, >= 6 steps.

  * optimizer/soap.py vs pytorch_optimizer.SOAP (the authors' algorithm: update 1 only builds the
    eigenbases, QR refreshes every precondition_frequency updates), weight_decay 0: the reference
    decays after its step, p·(1 - lr·wd) of the updated p, where optax (and every optimizer here)
    decays the p the step started from; the difference is second order (lr²·wd) but not zero.
    Square matrices, as in tests/test_soap.py (unique eigenbases); the bases each side computes
    are compared, then the reference carries on from ours (its state["Q"] set to ours).
  * optimizer/mars.py vs pytorch_optimizer.MARS (mars_type adamw, optimize_1d false), weight decay
    0.1 (decoupled, times the lr, on the starting p in both), eps 0: the reference adds eps to √v
    before its bias correction ((√v + eps)/√(1 - b2^t)), the authors' code and ours after (√v̂ + eps).
  * optimizer/kron.py vs kron_torch.Kron (Evan Walters', the same algorithm as psgd_jax), weight
    decay 0.1 on the matrix. Aligned: the probes V (torch.randn_like returns the ones our update
    draws); kron_torch damps the momentum in place inside its preconditioner update, so its step
    then preconditions the damped momentum (psgd_jax does not): it is given a copy to damp;
    torch.compile is off (eager kron_torch; the same functions). Not aligned, as they change
    nothing in exact arithmetic: the 1% factor rebalancing (its own RNG), the spectral-norm bound
    taken from a column (kron_torch) or a row (psgd_jax) of a symmetric matrix, tiny added or
    clamped.

Tolerances as in the float64 tests (tests/test_soap.py, test_mars.py, test_kron.py): both sides are
float32, each within those bounds of the exact result.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import EPS32

torch = pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]' (torch==2.13.0 CPU)")
pytorch_optimizer = pytest.importorskip("pytorch_optimizer",
                                        reason="parity tier: pip install -e '.[dev,parity]' (pytorch-optimizer 4.1.0)")
kron_torch = pytest.importorskip("kron_torch", reason="parity tier: pip install -e '.[dev,parity]' (kron-torch 0.3.3)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import test_soap  # noqa: E402  (tests/ is on the path, as for helpers)
from test_soap import basis_error, conditioning, np_soap, our_bases, random_grads, run, soap  # noqa: E402

from optimizer.kron import Kron, probes  # noqa: E402
from optimizer.mars import MARS  # noqa: E402

LR, STEPS = 0.01, 7
# Steps are read off the parameters (p_t - p_{t-1}): parameters of the steps' size (~lr) keep
# that difference exact to ~EPS32 of the step (parameters ~1 would cost ~EPS32/lr = 1e-5 of it).
P0_SCALE = LR


def torch_run(make, params0: list[np.ndarray], grads: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """The reference's parameters after each step, fed the given gradients."""
    params = [torch.tensor(p, requires_grad=True) for p in params0]
    opt = make(params)
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g)
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out


def jax_run(tx, params0: dict, grads: list[dict]) -> tuple[list[dict], object]:
    """Ours: (params after each step, the last state); jitted update, optax.apply_updates."""
    params = {k: jnp.asarray(v) for k, v in params0.items()}
    state = tx.init(params)

    @jax.jit
    def step(g, state, params):
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    out = []
    for g in grads:
        params, state = step({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        out.append({k: np.asarray(v) for k, v in params.items()})
    return out, state


def assert_steps_close(ours, theirs, params0, tol, what):
    """The steps (p_t - p_{t-1}) agree to `tol` relative to the step's norm, every step."""
    before_o, before_t = params0, params0
    for t, (o, r) in enumerate(zip(ours, theirs), 1):
        step_o, step_t = o - before_o, r - before_t
        err = np.linalg.norm(step_o - step_t) / max(np.linalg.norm(step_t), 1e-30)
        assert err < tol, f"{what} step {t}: {err:.2e} (tolerance {tol:.2e})"
        before_o, before_t = o, r


# --- SOAP ------------------------------------------------------------------------------------------


def test_soap_matches_pytorch_optimizer():
    """As tests/test_soap.py against its float64 reference: after each step the reference's bases
    (where it computed new ones) are compared with ours (up to column signs) and replaced by ours,
    so the next step's QR starts from the same basis and the steps compare everything but the
    bases' rounding, which Adam's per-entry division would amplify (`spread`)."""
    freq = 2
    grads = random_grads({"w": (5, 5)}, STEPS, seed=0)
    outs, states = run(soap(precondition_frequency=freq), grads)
    bases = our_bases(states, "w", (0, 0), 5, 5)
    ws = [g["w"] for g in grads]
    _, _, spread = np_soap(ws, freq, ours=bases)

    p = torch.tensor(P0_SCALE * np.random.default_rng(1).normal(size=(5, 5)).astype(np.float32), requires_grad=True)
    opt = pytorch_optimizer.SOAP(
        [p], lr=LR, betas=(test_soap.B1, test_soap.B2), shampoo_beta=test_soap.SHAMPOO_BETA, weight_decay=0.0,
        precondition_frequency=freq, max_precondition_dim=10000, merge_dims=False, precondition_1d=False,
        correct_bias=True, normalize_gradient=False, eps=test_soap.EPS)
    stats_l, stats_r = np.zeros((5, 5)), np.zeros((5, 5))
    for t, g in enumerate(ws, 1):
        before = p.detach().numpy().astype(np.float64)
        p.grad = torch.tensor(g)
        opt.step()
        step = p.detach().numpy().astype(np.float64) - before
        g = g.astype(np.float64)
        stats_l = test_soap.SHAMPOO_BETA * stats_l + (1 - test_soap.SHAMPOO_BETA) * g @ g.T
        stats_r = test_soap.SHAMPOO_BETA * stats_r + (1 - test_soap.SHAMPOO_BETA) * g.T @ g
        if t == 1 or (t - 1) % freq == 0:  # the reference computed bases this step
            for side, (stats, theirs) in enumerate(zip((stats_l, stats_r), opt.state[p]["Q"])):
                kappa = conditioning(stats, "eigh" if t == 1 else "qr")
                err = basis_error(bases[t - 1][side], theirs.numpy().astype(np.float64))
                assert err <= 2 * 10 * EPS32 * kappa, f"step {t}, side {side}: {err:.2e} (conditioning {kappa:.1f})"
            opt.state[p]["Q"] = [torch.tensor(q.astype(np.float32)) for q in bases[t - 1]]
        if t == 1:
            assert np.all(step == 0.0)  # update 1 only initialises, in both
            continue
        # Both float32, each within tests/test_soap.py's 20·EPS32·spread of the exact step; the step
        # read off the parameters adds ~EPS32·|p|/|step| = EPS32 (parameters of the step's size).
        err = np.linalg.norm(step + LR * outs[t - 1]["w"]) / np.linalg.norm(LR * outs[t - 1]["w"])
        assert err < 2 * 20 * EPS32 * spread + EPS32, f"step {t}: {err:.2e} (spread {spread:.1f})"


# --- MARS ------------------------------------------------------------------------------------------


def test_mars_matches_pytorch_optimizer():
    b1, b2, gamma, wd = 0.95, 0.99, 0.025, 0.1
    rng = np.random.default_rng(2)
    p0 = (P0_SCALE * rng.normal(size=(5, 4))).astype(np.float32)
    scales = (0.02, 0.3, 0.05, 0.25, 0.01, 0.15, 0.04)  # the correction's norm crosses the clip at 1 both ways
    grads = [(s * rng.normal(size=(5, 4))).astype(np.float32) for s in scales]
    theirs = torch_run(lambda ps: pytorch_optimizer.MARS(
        ps, lr=LR, betas=(b1, b2), gamma=gamma, mars_type="adamw", optimize_1d=False, weight_decay=wd,
        weight_decouple=True, fixed_decay=False, ams_bound=False, cautious=False, eps=0.0), [p0],
        [[g] for g in grads])
    ours, _ = jax_run(_with_eps(MARS(b1=b1, b2=b2, gamma=gamma, weight_decay=wd), 0.0, LR), {"w": p0},
                      [{"w": g} for g in grads])
    # tests/test_mars.py's 100·EPS32 per side (the steps are Adam-normalised, O(lr) per entry).
    assert_steps_close([o["w"] for o in ours], [t[0] for t in theirs], p0, 200 * EPS32, "MARS")


def _with_eps(hp: MARS, eps: float, lr: float) -> optax.GradientTransformation:
    """MARS.transform's hidden chain with another eps (MARS.check refuses 0; the transform does not)."""
    from optimizer.mars import scale_by_mars

    return optax.chain(scale_by_mars(hp.b1, hp.b2, hp.gamma, eps), optax.add_decayed_weights(hp.weight_decay),
                       optax.scale_by_learning_rate(optax.constant_schedule(lr)))


# --- Kron ------------------------------------------------------------------------------------------


def test_kron_matches_kron_torch(monkeypatch):
    from kron_torch import kron as kron_module

    wd = 0.1
    rng = np.random.default_rng(3)
    w0 = (P0_SCALE * rng.normal(size=(5, 4))).astype(np.float32)
    b0 = (P0_SCALE * rng.normal(size=(4,))).astype(np.float32)
    grads = [{"w": rng.normal(size=(5, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
             for _ in range(STEPS)]
    # Ours: the matrix group (hidden) decays, the vector (scalar) does not, as kron_torch (p.dim() >= 2).
    hp = Kron(momentum=0.9, weight_decay=wd)
    labels = {"w": "hidden", "b": "scalar"}
    tx = optax.multi_transform({"hidden": hp.transform("hidden", optax.constant_schedule(LR)),
                                "scalar": Kron(momentum=0.9, weight_decay=0.0).transform("scalar",
                                                                                    optax.constant_schedule(LR))},
                               labels)
    ours, state = jax_run(tx, {"w": w0, "b": b0}, grads)
    q_left = np.asarray(state.inner_states["hidden"].inner_state[0].q_left["w"], np.float64)
    q_right = np.asarray(state.inner_states["hidden"].inner_state[0].q_right["w"], np.float64)
    cond = max(np.linalg.cond(q_left), np.linalg.cond(q_right))
    assert cond < 10

    # The V each of our updates drew, per group (the group's seed is its index in optimizer.groups.GROUPS),
    # drawn from the bias-corrected momentum's tree of that group.
    from optimizer.groups import GROUPS

    vs = []
    for t in range(STEPS):
        draw = {}
        for name, group in (("w", "hidden"), ("b", "scalar")):
            tree = {k: (jnp.zeros(grads[0][k].shape) if k == name else optax.MaskedNode()) for k in ("b", "w")}
            draw[name] = np.asarray(probes(GROUPS.index(group), jnp.int32(t), tree)[1][name])
        vs.append(draw)
    queue = [torch.tensor(v[name]) for v in vs for name in ("w", "b")]  # kron_torch's order: its params list

    monkeypatch.setattr(torch, "randn_like", lambda g, **kw: queue.pop(0))
    original = kron_module._calc_A_and_conjB
    monkeypatch.setattr(kron_module, "_calc_A_and_conjB", lambda expr, g, q: original(expr, g.clone(), q))
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    theirs = torch_run(lambda ps: kron_module.Kron(
        ps, lr=LR, b1=0.9, weight_decay=wd, preconditioner_update_probability=None, max_size_triangular=8192,
        min_ndim_triangular=2, memory_save_mode=None, momentum_into_precond_update=True, precond_lr=0.1,
        precond_init_scale=1.0, merge_dims=True), [w0, b0], [[g["w"], g["b"]] for g in grads])
    assert queue == []  # every probe consumed: a preconditioner update on every step, as ours
    # tests/test_kron.py's 100·EPS32·cond(Q) per side.
    tol = 2 * 100 * EPS32 * cond
    assert_steps_close([o["w"] for o in ours], [t[0] for t in theirs], w0, tol, "Kron matrix")
    assert_steps_close([o["b"] for o in ours], [t[1] for t in theirs], b0, tol, "Kron vector")
