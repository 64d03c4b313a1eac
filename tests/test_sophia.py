"""The seam Sophia needs (trainer/step.py's Hutchinson estimate, optimizer/contract.py's
`hessian_due`): the estimate is unbiased for the Hessian diagonal, the step passes ONE estimate of
its own loss (all micro-batches) on the due steps and zeros on the others, and an optimizer that
declares nothing compiles the step it compiled before the seam existed. The update itself is checked
against optax and pytorch_optimizer in tests/test_parity_sophia.py."""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, sum_atol

import train_jax as T
from models import losses
from models.gpt import param_axes
from optimizer.adamw import AdamW
from optimizer.sophia import Sophia
from trainer import precompile, step_metrics
from trainer.step import build_train_step, hutchinson_diagonal
from utils.errors import ConfigError
from utils.parallel import layout
from utils.parallel import mesh as meshlib


def test_hutchinson_mean_over_many_probes_is_the_exact_hessian_diagonal():
    """½·xᵀAx, A a dense symmetric 16×16: z_i·(Az)_i = A_ii + z_i·Σ_(j≠i) A_ij z_j. Given z_i the
    second term is a Rademacher sum, sub-Gaussian with variance proxy σ_i² = Σ_(j≠i) A_ij², so the mean
    of N independent probes errs by more than λ·σ_i/√N with probability <= 2·exp(−λ²/2) (Hoeffding):
    λ = 8, 2.5e-14 a coordinate. Plus float32: each (Az)_i a 16-term dot product (sum_atol), the
    product with z exact (±1), the mean of N a sum of N terms of size <= Σ_j|A_ij| (sum_atol again)."""
    n, probes, lam = 16, 4096, 8.0
    rng = np.random.default_rng(0)
    a = rng.normal(size=(n, n))
    a_f32 = ((a + a.T) / 2).astype(np.float32)
    a64 = a_f32.astype(np.float64)

    def grad_fn(p):
        return {"x": jnp.asarray(a_f32) @ p["x"]}  # the gradient of ½·xᵀAx

    params = {"x": jnp.asarray(rng.normal(size=n), jnp.float32)}
    keys = jax.random.split(jax.random.PRNGKey(0), probes)
    estimates = jax.jit(jax.vmap(lambda k: hutchinson_diagonal(grad_fn, params, k)["x"]))(keys)
    mean = np.asarray(estimates, np.float64).mean(axis=0)
    off = a64 - np.diag(np.diag(a64))
    sigma = np.sqrt((off**2).sum(axis=1))
    row = np.abs(a64).sum(axis=1)
    bound = lam * sigma / np.sqrt(probes) + sum_atol(n, row) + sum_atol(probes, row)
    assert np.all(np.abs(mean - np.diag(a64)) <= bound), np.abs(mean - np.diag(a64)) / bound
    # and it is an estimate, not the diagonal itself: one probe errs by ~σ_i
    assert np.abs(np.asarray(estimates[0]) - np.diag(a64)).max() > 0.1 * sigma.max()


class Count(NamedTuple):
    count: jax.Array


def estimate_as_update() -> optax.GradientTransformationExtraArgs:
    """A stand-in optimizer whose update IS the estimate the step handed it (due: even counts)."""
    def update(updates, state, params=None, hessian_diag=None):
        return hessian_diag, Count(state.count + 1)
    return optax.GradientTransformationExtraArgs(lambda p: Count(jnp.zeros([], jnp.int32)), update)


def _assembled(tiny_run, tx):
    run = tiny_run("logging.log_callback_data=false")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, _ = T.init_training(run, mesh)
    state = eqx.tree_at(lambda s: s.opt_state, state, tx.init(eqx.filter(state.model, eqx.is_array)))
    abstract = jax.eval_shape(lambda: state)
    shardings = layout.state_shardings(mesh, abstract, abstract.model, param_axes(abstract.model))
    metrics = step_metrics.defaults(optax.constant_schedule(1e-3), {}, [])
    return run, mesh, state, shardings, metrics


@pytest.mark.slow  # ~7 s: builds and runs a tiny GPT's step
def test_the_step_hands_one_estimate_of_its_own_loss_on_due_steps_and_zeros_between(tiny_run):
    """The loss differentiated is Σ c_b·θ²/2 over every weight, c_b = 1 + (first token of micro-batch
    b)/4: its Hessian is diagonal, so z ⊙ (Hz) = c·z² is exactly c whatever the probes, and the
    step's estimate over two micro-batches must be exactly their mean c̄ (dyadic: no rounding). The
    stand-in optimizer moves the weights by the estimate: +c̄ at steps 0 and 2 (due), nothing at 1."""
    def loss_fn(model, tokens_BxT1, key, compute_dtype):
        _, aux = losses.loss_fn(model, tokens_BxT1, key, compute_dtype)
        c = 1.0 + tokens_BxT1[0, 0].astype(jnp.float32) / 4
        weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        quadratic = sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in weights)
        loss = c * quadratic / 2
        return loss, {**aux, "loss": loss}

    tx = estimate_as_update()
    run, mesh, state, shardings, metrics = _assembled(tiny_run, tx)
    step = build_train_step(loss_fn, tx, metrics, shardings, mesh, "float32", False,
                            hessian_due=lambda s: s.count % 2 == 0)
    batch = np.ones((2, run.dataset.batch_size, run.context_length + 1), np.int32)
    batch[0, 0, 0], batch[1, 0, 0] = 2, 5  # c = 1.5 and 2.25: c̄ = 1.875
    batch = meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1))
    leaves = lambda s: [np.asarray(x) for x in jax.tree.leaves(eqx.filter(s.model, eqx.is_inexact_array))]
    before = leaves(state)
    for t, moved in enumerate([1.875, 0.0, 1.875]):
        state, _ = step(state, batch, False)
        after = leaves(state)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a, b + np.float32(moved), err_msg=f"step {t}")
        before = after


@pytest.mark.slow  # ~4 s: lowers three steps
def test_an_optimizer_that_declares_no_hessian_compiles_the_step_it_did(tiny_run):
    """AdamW through the seam (its hessian_due, the contract's default None) lowers to the StableHLO
    text of the step built without it; Sophia's differs (the estimate's cond), so the check can fail."""
    run = tiny_run("logging.log_callback_data=false")
    loss = losses.loss_fn

    def text(tx, hessian_due, state):
        abstract = jax.eval_shape(lambda: state)
        mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
        shardings = layout.state_shardings(mesh, abstract, abstract.model, param_axes(abstract.model))
        metrics = step_metrics.defaults(optax.constant_schedule(1e-3), {}, [])
        step = build_train_step(loss, tx, metrics, shardings, mesh, "float32", False, hessian_due=hessian_due)
        batch = jax.ShapeDtypeStruct((1, run.dataset.batch_size, run.context_length + 1), jnp.int32)
        return step.plain.trace(*precompile.abstract((state, batch, step.args))).lower().as_text(debug_info=False)

    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, _ = T.init_training(run, mesh)
    params = eqx.filter(state.model, eqx.is_array)
    adamw = optax.adamw(1e-3)
    adam_state = eqx.tree_at(lambda s: s.opt_state, state, adamw.init(params))
    plain = text(adamw, None, adam_state)
    assert text(adamw, AdamW().hessian_due, adam_state) == plain
    assert AdamW().hessian_due(adam_state.opt_state) is None
    sophia = Sophia()
    sophia_tx = optax.multi_transform({"hidden": sophia.transform("hidden", optax.constant_schedule(1e-3))},
                                      lambda p: jax.tree.map(lambda _: "hidden", p))
    sophia_state = eqx.tree_at(lambda s: s.opt_state, state, sophia_tx.init(params))
    assert "stablehlo.case" not in plain
    assert "stablehlo.case" in text(sophia_tx, sophia.hessian_due, sophia_state)  # the estimate's lax.cond


@pytest.mark.parametrize(("knob", "value"), [("precondition_every", 0), ("gamma", 0.0), ("clip_threshold", -1.0),
                                             ("b2", 1.0), ("eps", 0.0)])
def test_bad_knobs_are_refused_in_one_line(knob, value):
    import dataclasses

    with pytest.raises(ConfigError, match=rf"^optimizer\.{knob}=") as err:
        dataclasses.replace(Sophia(), **{knob: value}).check("optimizer")
    assert "\n" not in str(err.value)


def test_clip_fraction_and_hessian_mean_are_those_of_the_update():
    """After two updates on known values: the logged clip_fraction is the share of |u| at the
    threshold in the second update (NumPy), hessian_mean the mean of the EMA of the estimate."""
    from optimizer import make_optimizer
    from optimizer.diagnostics import optimizer_metrics

    hp = Sophia(b1=0.0, b2=0.5, gamma=1.0, precondition_every=1, weight_decay=0.0)
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    labels = {"w": "hidden"}
    tx = make_optimizer(hp, optax.constant_schedule(1.0), labels, None)
    h1, h2 = (jnp.asarray(rng.uniform(0.5, 2.0, size=(8, 4)), jnp.float32) for _ in range(2))
    g = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    _, s = tx.update({"w": g}, tx.init(params), params, hessian_diag={"w": h1})
    u, s = tx.update({"w": g}, s, params, hessian_diag={"w": h2})
    nu_used = 0.5 * np.asarray(h1, np.float64)  # the EMA after step 0, what step 1 divides by
    expected_clip = np.mean(np.abs(np.asarray(g, np.float64) / nu_used) >= 1.0)
    assert 0 < expected_clip < 1
    got = optimizer_metrics(hp, s, params)
    assert float(got["optim/hidden/clip_fraction"]) == expected_clip  # k/32: exact in float32
    nu_now = 0.5 * nu_used + 0.5 * np.asarray(h2, np.float64)
    # the EMA: <= 4 roundings an element (the product and sum of step 0, two products and a sum of
    # step 1, all terms positive: relative), then a sum of 32 positive terms (sum_atol at scale 1 is
    # its relative error) and an exact division by 32
    np.testing.assert_allclose(float(got["optim/hidden/hessian_mean"]), nu_now.mean(),
                               rtol=2 * (5 * EPS32 / 2) + sum_atol(32, 1.0))
    del u


def test_a_non_finite_hessian_estimate_skips_the_step_as_a_non_finite_gradient_does():
    """train.skip_nonfinite: with a finite gradient but a NaN in the estimate, the step is skipped
    (zero update, the moments and Hessian average kept, total_notfinite counted), where letting it
    through would make every later update NaN; a finite estimate steps as before."""
    from optimizer import make_optimizer
    from optimizer.nonfinite import skip_nonfinite

    hparams = Sophia()
    params = {"w": jnp.ones((4, 6), jnp.float32), "b": jnp.ones((6,), jnp.float32)}
    tx = skip_nonfinite(make_optimizer(hparams, lambda _: 1e-2, {"w": "hidden", "b": "scalar"}, None, 1e-2, {}), 3)
    state = tx.init(params)
    grads = {k: jnp.full_like(p, 0.5) for k, p in params.items()}
    finite = {k: jnp.full_like(p, 2.0) for k, p in params.items()}
    updates, after_finite = tx.update(grads, state, params, hessian_diag=finite)
    assert all(float(jnp.abs(u).max()) > 0 for u in updates.values())
    assert int(after_finite.total_notfinite) == 0
    bad = {**finite, "w": finite["w"].at[1, 2].set(jnp.nan)}
    updates, after_bad = tx.update(grads, after_finite, params, hessian_diag=bad)
    assert all(float(jnp.abs(u).max()) == 0 for u in updates.values())
    assert int(after_bad.total_notfinite) == 1
    for kept, was in zip(jax.tree.leaves(after_bad.inner_state), jax.tree.leaves(after_finite.inner_state)):
        if jnp.issubdtype(kept.dtype, jnp.floating):  # moments and the Hessian average: kept as they were
            np.testing.assert_array_equal(kept, was)
