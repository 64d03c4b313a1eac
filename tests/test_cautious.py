"""optimizer.cautious (optimizer/cautious.py): the mask against NumPy; every registered optimizer
with the mask on its direction and not on its weight decay; the logged kept fraction against an
independent count (on tiny pytrees and through the train step); cautious=false tracing to the
very computation it did before; the knob's checks. Parity with pytorch_optimizer's cautious
Lion and Adafactor: tests/test_parity_basics.py."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, check_bool_knob, optimizer_update, per_optimizer

import train_jax as T
from models import losses
from optimizer import OPTIMIZERS, make_optimizer
from optimizer import cautious as C
from optimizer.adamw import AdamW
from optimizer.diagnostics import cautious_kept_fraction, find_states, optimizer_metrics
from optimizer.groups import BASE_GROUPS, group_hparams, group_schedules
from optimizer.nonfinite import skip_nonfinite
from optimizer.restart import schedules_at
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

SHAPES = {"w": ((2, 8, 12), "hidden"), "h": ((12, 10), "head"), "e": ((10, 8), "embed"), "b": ((8,), "scalar")}
LABELS = {k: label for k, (_, label) in SHAPES.items()}
BASE_LR = 1e-2
OVERRIDES = {"head": {"lr": 5e-3}}  # a decayed group at its own peak: its decay must follow its own lr
SCHEDULE = optax.linear_schedule(2e-3, BASE_LR, 4)  # warmup: each update checked runs at another lr
STEPS = 3


def np_mask(u, g) -> tuple[np.ndarray, int]:
    """The paper's rule in float64: keep where the update (which moves the params) goes against
    the gradient, rescale by 1/max(kept fraction, 1e-3); and the number kept."""
    u, g = np.asarray(u, np.float64), np.asarray(g, np.float64)
    agree = u * g < 0
    return np.where(agree, u / max(agree.mean(), C.MIN_KEPT), 0.0), int(agree.sum())


def _random_tree(rng, scale=1.0):
    return {k: jnp.asarray(scale * rng.normal(size=shape), jnp.float32) for k, (shape, _) in SHAPES.items()}


# --- the mask itself ---------------------------------------------------------------------------


def _mask_cases():
    rng = np.random.default_rng(0)
    u, g = rng.normal(size=(3, 5, 7)), rng.normal(size=(3, 5, 7))
    u[0, 0, :3], g[1, 1, :3] = 0.0, 0.0  # a zero on either side agrees with nothing
    rare = np.abs(rng.normal(size=2000))  # against g = 1: u·g > 0 (disagrees) but at one component,
    rare[17] = -rare[17]  # 1/2000 kept, under the guard
    tiny = np.array([1e-30, -1e-30, 1e-30, 2.0])  # u·g underflows to 0 in float32, the signs do not
    return {"random": (u, g), "none_kept": (u, u * 3.0), "one_in_2000": (rare, np.ones(2000)),
            "underflow": (tiny, np.array([-1e-30, 1e-30, 1e-30, -1.0]))}


@pytest.mark.parametrize("case", sorted(_mask_cases()))
def test_mask_matches_numpy(case):
    u, g = _mask_cases()[case]
    masked, kept = C.mask_disagreeing(jnp.asarray(u, jnp.float32), jnp.asarray(g, jnp.float32))
    expected, expected_kept = np_mask(u.astype(np.float32), g.astype(np.float32))
    assert int(kept) == expected_kept == {"none_kept": 0, "one_in_2000": 1, "underflow": 3}.get(case, expected_kept)
    # float32: the fraction kept/n and the division each round once: <= 2 EPS32 relative
    np.testing.assert_allclose(np.asarray(masked, np.float64), expected, rtol=4 * EPS32, atol=0)
    if case == "one_in_2000":  # 1/2000 < MIN_KEPT: the rescale is capped at 1/MIN_KEPT = 1000x, not 2000x
        np.testing.assert_allclose(float(masked[17]), u[17] * 1000.0, rtol=4 * EPS32)


def test_mask_keeps_the_dtype_of_bfloat16_updates():
    u = jnp.asarray([1.0, -2.0, 3.0, -4.0], jnp.bfloat16)
    masked, kept = C.mask_disagreeing(u, jnp.asarray([-1.0, -1.0, 1.0, 1.0], jnp.bfloat16))
    assert masked.dtype == jnp.bfloat16 and int(kept) == 2
    np.testing.assert_array_equal(np.asarray(masked, np.float32), [2.0, 0.0, 0.0, -8.0])  # x 1/0.5, exact


# --- every registered optimizer --------------------------------------------------------------------


def _unsupported(name) -> str | None:
    return getattr(OPTIMIZERS[name], "CAUTIOUS_UNSUPPORTED", None)


def _with_decay(name):
    hp = OPTIMIZERS[name]()
    return dataclasses.replace(hp, weight_decay=0.1) if hasattr(hp, "weight_decay") else hp


@pytest.mark.parametrize("name", per_optimizer(sorted(OPTIMIZERS)))
def test_every_optimizer_masks_its_direction_not_its_weight_decay(name):
    """Three updates of the same grads and params through (a) the optimizer, (b) it with
    weight_decay=0, (c) it with cautious=true: (c) = mask(b) + (a − b), where a − b is the
    optimizer's own decoupled decay, left unmasked; and the kept fraction the diagnostics read
    from (c)'s state is the NumPy count of agreeing components over all leaves. Grads at norm ~10
    under clip 1: the mask must hold for the clipped gradient too (a positive factor)."""
    hp = _with_decay(name)
    if _unsupported(name):  # declared: refused, never built silently
        with pytest.raises(ConfigError, match=r"optimizer\.cautious"):
            make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES, cautious=True)
        return
    rng = np.random.default_rng(1)
    params_seq = [_random_tree(rng) for _ in range(STEPS)]
    grads_seq = [_random_tree(rng, scale=2.0) for _ in range(STEPS)]
    off0_hp = dataclasses.replace(hp, weight_decay=0.0) if hasattr(hp, "weight_decay") else hp
    txs = [make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES),
           make_optimizer(off0_hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES),
           make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES, cautious=True)]

    @jax.jit  # one compilation for the three optimizers and steps
    def run(params_seq, grads_seq):
        states = [tx.init(params_seq[0]) for tx in txs]
        out = []
        for p, g in zip(params_seq, grads_seq):
            step = [optimizer_update(tx, g, s, p, hp) for tx, s in zip(txs, states)]
            states = [s for _, s in step]
            out.append(([u for u, _ in step], cautious_kept_fraction(states[2], p)))
        return out

    for t, ((u_wd, u_0, u_on), logged) in enumerate(run(params_seq, grads_seq)):
        kept, size = 0, 0
        for k in SHAPES:
            a, b, c = (np.asarray(x[k], np.float64) for x in (u_wd, u_0, u_on))
            masked, n = np_mask(b, grads_seq[t][k])
            kept, size = kept + n, size + b.size
            # float32 at the leaf's scale: a − b rounds a and b (<= 1 EPS32 each), the rescale
            # <= 2 EPS32, and the same direction compiled in another program rounds differently
            # where it sums over a row (Newton–Schulz, preconditioners: EPS32 of the leaf's largest
            # values, not of the element). Measured <= 2 EPS32·scale for every optimizer; 8 leaves
            # room. A decay masked with the direction is off by lr·wd·|p| ~ 1e4 times the bound.
            bound = 8 * EPS32 * max(np.abs(a).max(), np.abs(b).max(), np.abs(masked).max())
            assert np.all(np.abs(c - (masked + a - b)) <= bound), f"{name}: step {t + 1}, leaf {k}"
        np.testing.assert_allclose(float(logged["optim/cautious_kept_fraction"]), kept / size, rtol=2 * EPS32,
                                   err_msg=f"{name}: step {t + 1}")
    names = jax.eval_shape(lambda s, p: optimizer_metrics(hp, s, p), txs[2].init(params_seq[0]), params_seq[0])
    assert "optim/cautious_kept_fraction" in names  # what the train step logs


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cautious_false_traces_to_the_computation_it_replaced(name):
    """cautious=false must be bit-identical to the chain make_optimizer built before the knob
    existed (clip, then optax.multi_transform of each group's own transform): the same state
    structure and the same jaxpr for init and update, hence the same bits (golden losses unchanged)."""
    hp = _with_decay(name)
    schedules = group_schedules(hp, SCHEDULE, BASE_LR, OVERRIDES)
    before = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
        {g: group_hparams(hp, g, OVERRIDES).transform(g, schedules[g]) for g in BASE_GROUPS}, lambda _params: LABELS))
    now = make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES)
    rng = np.random.default_rng(2)
    params, grads = _random_tree(rng), _random_tree(rng)

    def traced(tx):
        state = tx.init(params)
        return (jax.tree.structure(state), str(jax.make_jaxpr(tx.init)(params)),
                str(jax.make_jaxpr(lambda g, s, p: optimizer_update(tx, g, s, p, hp))(grads, state, params)))

    assert traced(now) == traced(before)


def test_the_decay_counter_moves_with_the_optimizers_own_schedule():
    """The decay split off the direction counts its lr steps in an optax.ScaleByScheduleState, so
    a skipped non-finite step (optimizer/nonfinite.py) and a fresh state at step N
    (optimizer/restart.py) move it with the optimizer's own lr counters: after one skipped step
    every counter reads 1, and the next update decays by its group's lr at schedule step 1."""
    hp = AdamW(weight_decay=0.1)
    rng = np.random.default_rng(3)
    params, grads = _random_tree(rng), _random_tree(rng)
    tx = skip_nonfinite(make_optimizer(hp, SCHEDULE, LABELS, None, BASE_LR, OVERRIDES, cautious=True), 3)
    plain = make_optimizer(dataclasses.replace(hp, weight_decay=0.0), SCHEDULE, LABELS, None, BASE_LR, OVERRIDES)
    nan = jax.tree.map(lambda g: g * np.nan, grads)

    @jax.jit
    def after_a_skip(params, grads):
        _, state = tx.update(nan, tx.init(params), params)
        updates, _ = tx.update(grads, state, params)
        direction, _ = plain.update(grads, plain.init(params), params)  # Adam's first step: no history
        return state, updates, direction

    state, updates, direction = after_a_skip(params, grads)
    counters = find_states(state, optax.ScaleByScheduleState)
    assert len(counters) == 4 + 2  # AdamW's lr stage in each group, the split decay in hidden and head
    assert all(int(c.count) == 1 for c in counters)
    assert all(int(c.count) == 7 for c in find_states(schedules_at(state, 7), optax.ScaleByScheduleState))
    peaks = {"hidden": BASE_LR, "head": OVERRIDES["head"]["lr"]}
    for k, label in LABELS.items():
        masked, _ = np_mask(direction[k], grads[k])  # plain ran at schedule step 0: rescale it to step 1
        masked *= float(SCHEDULE(1)) / float(SCHEDULE(0))
        decay = -float(SCHEDULE(1)) * peaks[label] / BASE_LR * 0.1 * np.asarray(params[k]) if label in peaks else 0.0
        # float32: each term rounds a few times (the lr ratio, the rescale, the decay's product)
        bound = 8 * EPS32 * (np.abs(masked) + np.abs(decay))
        assert np.all(np.abs(np.asarray(updates[k], np.float64) - (masked + decay)) <= bound), k


# --- the knob ----------------------------------------------------------------------------------


def test_the_knob_validates_and_defaults_to_off(tiny_run):
    check_bool_knob(tiny_run, "cautious", "lion")


@dataclasses.dataclass(frozen=True)
class _DecaysElsewhere(AdamW):
    CAUTIOUS_UNSUPPORTED = "its weight decay is taken at another point than the params"


def test_an_optimizer_can_refuse_the_mask():
    with pytest.raises(ConfigError, match=r"optimizer\.cautious=true is not available for optimizer\.name=x: its "
                                          r"weight decay .*; set optimizer\.cautious=false"):
        C.check(_DecaysElsewhere(), "x")
    C.check(AdamW(), "adamw")
    with pytest.raises(ConfigError, match=r"optimizer\.cautious"):
        make_optimizer(_DecaysElsewhere(), SCHEDULE, LABELS, None, cautious=True)


# --- through the train step ----------------------------------------------------------------------


def test_kept_fraction_logged_by_the_step_is_that_of_its_update(tiny_run):
    """Logging steps of the tiny GPT under cautious AdamW without weight decay: the update the
    step applied (recomputed here by the run's own tx from a copy of the state it started from)
    is nonzero exactly on the kept components, each against its gradient's sign, and the logged
    fraction is their count over all components."""
    run = tiny_run("optimizer.cautious=true", "optimizer.weight_decay=0.0", "logging.log_callback_data=true",
                   "logging.store_last_params=false", "logging.store_last_grads=false",
                   "logging.store_past_grads=false", "train.gradient_clip_val=null", "optimizer/lr_config=constant",
                   "optimizer.lr_config.warmup=0")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, tx, state, step = T.init_training(run, mesh)
    grad_fn = eqx.filter_jit(eqx.filter_grad(lambda m, t: losses.loss_fn(m, t, None, "float32")[0]))
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    dropped = 0  # components with a gradient that the mask zeroed
    for k in range(3):
        batch = rng.integers(0, 64, (1, 8, 17), dtype=np.int32)
        model, opt_state = jax.tree.map(jnp.copy, (eqx.filter(state.model, eqx.is_array), state.opt_state))
        state, metrics = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), True)  # donates
        grads = grad_fn(eqx.combine(model, state.model), jnp.asarray(batch[0]))
        updates, _ = update(grads, opt_state, model)
        kept, size = 0, 0
        for g, u in zip(jax.tree.leaves(grads), jax.tree.leaves(updates), strict=True):
            g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
            assert np.all(u * g <= 0), f"step {k + 1}: an update component goes with its gradient"
            kept, size = kept + int(np.count_nonzero(u)), size + u.size
            dropped += int(np.count_nonzero((u == 0) & (g != 0)))
        np.testing.assert_allclose(float(metrics["optim/cautious_kept_fraction"]), kept / size, rtol=2 * EPS32,
                                   err_msg=f"step {k + 1}")
    assert dropped > 0  # the mask acted (steps 2-3: momentum against a new batch's gradient)
