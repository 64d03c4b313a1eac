"""optimizer/: schedules against hand-computed values, weight-decay masks, clipping, SGD momentum
against a hand-written update, and the knob checks. Pure optax on tiny pytrees: no model runs."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.gpt import GPT, GPTConfig, param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer.adamw import AdamW
from optimizer.schedules import SCHEDULES, Constant, Cosine, Linear, PiecewiseLinear, Trapezoid
from optimizer.sgdm import SGDM
from utils.config import build_section
from utils.errors import ConfigError


def _values(schedule, steps) -> np.ndarray:
    return np.array([float(schedule(jnp.asarray(s, jnp.int32))) for s in steps])


# --- schedules ---------------------------------------------------------------------------------


def test_constant_with_and_without_warmup():
    s = Constant(lr=0.5, warmup=4).build(100)
    np.testing.assert_allclose(_values(s, [0, 1, 2, 3, 4, 5, 99, 1000]),
                               [0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5, 0.5], rtol=1e-6)  # warmup: lr*(step+1)/warmup
    np.testing.assert_allclose(_values(Constant(lr=0.5).build(100), [0, 1, 500]), [0.5] * 3, rtol=1e-6)


def test_linear_warmup_const_then_decay():
    # warmup 10 (lr*(step+1)/10), flat 20 steps (10..30), linear 1 -> 0.1 over the remaining 70 steps.
    s = Linear(lr=1.0, warmup=10, const=20, min_lr=0.1, max_steps=100).build(100)
    steps = [0, 5, 10, 20, 30, 65, 100, 150]
    expected = [0.1, 0.6, 1, 1, 1, 1 - 0.9 * 35 / 70, 0.1, 0.1]
    np.testing.assert_allclose(_values(s, steps), expected, rtol=1e-6, atol=1e-7)
    # const=None: the decay starts right after warmup (1 -> 0 over steps 10..50).
    s = Linear(lr=1.0, warmup=10, const=None).build(50)
    np.testing.assert_allclose(_values(s, [10, 20, 30, 50]), [1, 0.75, 0.5, 0], rtol=1e-6, atol=1e-7)


def test_cosine_endpoints_and_midpoint():
    s = Cosine(lr=1.0, warmup=10, min_lr=0.1, max_steps=110).build(110)
    quarter = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
    np.testing.assert_allclose(_values(s, [0, 5, 10, 35, 60, 110, 200]),
                               [0.1, 0.6, 1, quarter, 0.55, 0.1, 0.1], rtol=1e-5)


def test_trapezoid_plateau_and_decay():
    s = Trapezoid(lr=1.0, warmup=10, decay=20, min_lr=0.0).build(100)
    steps = [0, 5, 10, 40, 79, 80, 90, 95, 100]
    np.testing.assert_allclose(_values(s, steps), [0.1, 0.6, 1, 1, 1, 1, 0.5, 0.25, 0], rtol=1e-6, atol=1e-7)
    assert SCHEDULES["wsd"] is SCHEDULES["trapezoid"] is Trapezoid


def test_trapezoid_longer_than_the_run_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match="warmup.*decay.*max_steps"):
        Trapezoid(lr=1.0, warmup=60, decay=50).check_steps("optimizer.lr_config", 100)
    # ... and validate() runs that check, before any data or compilation.
    with pytest.raises(ConfigError, match="optimizer.lr_config: warmup"):
        tiny_run("optimizer/lr_config=trapezoid", "optimizer.lr_config.warmup=60",
                 "optimizer.lr_config.decay=50", "train.max_steps=100")


def test_warmup_longer_than_the_run_is_a_warning_not_an_error(tiny_run):
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.warmup=50", "train.max_steps=10")
    assert len(run.warnings) == 1 and "optimizer.lr_config" in run.warnings[0] and "warmup" in run.warnings[0]
    assert tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.warmup=5", "train.max_steps=10").warnings == ()


def test_min_lr_above_lr_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match=r"optimizer\.lr_config\.min_lr"):
        tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.min_lr=1.0", "optimizer.lr_config.lr=0.003")


def test_piecewise_linear_interpolates_and_is_flat_outside():
    s = PiecewiseLinear(lr=2.0, steps=(10, 20, 40), scales=(0.0, 1.0, 0.5)).build(100)
    steps = [0, 10, 15, 20, 30, 40, 100]
    np.testing.assert_allclose(_values(s, steps), [0, 0, 1, 2, 1.5, 1, 1], rtol=1e-6, atol=1e-7)


def test_schedule_max_steps_defaults_to_train_max_steps(tiny_run):
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.lr=1.0", "optimizer.lr_config.warmup=0",
                   "optimizer.lr_config.min_lr=0.0", "train.max_steps=40")
    assert run.optimizer.schedule_steps == 40
    s = run.optimizer.schedule.build(run.optimizer.schedule_steps)
    np.testing.assert_allclose(_values(s, [0, 20, 40]), [1, 0.5, 0], rtol=1e-6, atol=1e-7)
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.max_steps=25", "train.max_steps=40")
    assert run.optimizer.schedule_steps == 25


# --- weight decay masks ------------------------------------------------------------------------

CFG = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64, tie_embeddings=False)


def _params_and_labels():
    """Untied tiny GPT params with every leaf nonzero (fresh biases are 0: decay would not show)."""
    model = eqx.filter_eval_shape(GPT, CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)  # NumPy, not jax.random: no per-shape compilation
    params = jax.tree.map(lambda x: jnp.asarray(1.0 + rng.uniform(size=x.shape), jnp.float32), model)
    return params, param_labels(model)


def _first_update(tx, grads, params):
    """One jitted init + update (eager optax compiles every small op separately: much slower)."""
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def _expected_decay(path, decay_embeddings: bool) -> bool:
    """Independent of optimizer.groups: block matrices and the untied head, embeddings if asked."""
    names = [p.name for p in path]
    if names[0] == "blocks":
        return names[-1] == "weight_IxO"
    if names[0] in ("wte_VxD", "wpe_TxD"):
        return decay_embeddings
    return names[0] == "head_DxV"


@pytest.mark.parametrize("decay_embeddings", [False, True])
@pytest.mark.parametrize("opt", [AdamW(weight_decay=0.1), SGDM(momentum=0.9, weight_decay=0.1)],
                         ids=["adamw", "sgdm"])
def test_weight_decay_mask(opt, decay_embeddings):
    opt = dataclasses.replace(opt, decay_embeddings=decay_embeddings)
    lr = 0.5
    params, labels = _params_and_labels()
    tx = make_optimizer(opt, optax.constant_schedule(lr), labels, clip=1.0)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates = _first_update(tx, zero_grads, params)
    new_params = optax.apply_updates(params, updates)

    decayed = []
    for (path, p), p_new in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new_params)):
        name = ".".join(k.name for k in path)
        if _expected_decay(path, decay_embeddings):
            decayed.append(name)
            np.testing.assert_allclose(p_new, p * (1 - lr * 0.1), rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(p_new, p, err_msg=name)
    n_embed = 2 if decay_embeddings else 0
    assert len(decayed) == 4 + 1 + n_embed  # four block matrices, the head, the embeddings if asked


# --- clipping ----------------------------------------------------------------------------------


def _random_grads(params, norm: float, seed=2):
    rng = np.random.default_rng(seed)
    g = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
    scale = norm / np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
    return jax.tree.map(lambda x: jnp.asarray(x * scale, jnp.float32), g)


@pytest.mark.parametrize("opt", [SGDM(momentum=0.9), AdamW(eps=1.0, weight_decay=0.0)], ids=["sgdm", "adamw"])
def test_clipping_by_global_norm(opt):
    """SGDM is linear in the gradient and AdamW with a large eps nearly so, so a missing or wrong
    clip shows up in the update (plain Adam's first step is scale-invariant and would hide it)."""
    params, labels = _params_and_labels()
    lr = 0.1

    def first_update(grads, clip):
        return _first_update(make_optimizer(opt, optax.constant_schedule(lr), labels, clip), grads, params)

    big = _random_grads(params, 10.0)
    clipped = first_update(big, clip=2.0)
    reference = first_update(jax.tree.map(lambda g: g * 0.2, big), clip=None)  # the same grads at norm 2
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    unclipped = first_update(big, clip=None)
    assert not np.allclose(jax.tree.leaves(clipped)[0], jax.tree.leaves(unclipped)[0], rtol=1e-3)

    small = _random_grads(params, 1.5)  # below the clip: untouched
    for a, b in zip(jax.tree.leaves(first_update(small, clip=2.0)), jax.tree.leaves(first_update(small, clip=None))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    # clip 0 means off (train.gradient_clip_val: "null or 0 = off").
    for a, b in zip(jax.tree.leaves(first_update(big, clip=0.0)), jax.tree.leaves(unclipped)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_sgdm_clipped_update_by_hand():
    params, labels = _params_and_labels()
    big = _random_grads(params, 10.0)
    tx = make_optimizer(SGDM(momentum=0.9), optax.constant_schedule(0.1), labels, 2.0)
    updates = _first_update(tx, big, params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(big)):
        np.testing.assert_allclose(u, -0.1 * g * (2.0 / 10.0), rtol=1e-5, atol=1e-9)


# --- SGD with momentum by hand -------------------------------------------------------------------


def _two_steps(opt, g1, g2, p0, lr=0.1):
    params, labels = {"w": p0}, {"w": "hidden"}
    tx = make_optimizer(opt, optax.constant_schedule(lr), labels, None)
    state = tx.init(params)
    u1, state = tx.update({"w": g1}, state, params)
    params = optax.apply_updates(params, u1)
    u2, state = tx.update({"w": g2}, state, params)
    return np.asarray(u1["w"]), np.asarray(u2["w"])


def test_sgdm_matches_hand_computed_momentum():
    m, lr = 0.9, 0.1
    g1, g2, p0 = np.array([1.0, -2.0, 0.5]), np.array([0.5, 1.0, -1.0]), np.array([1.0, 1.0, 1.0])
    u1, u2 = _two_steps(SGDM(momentum=m), g1, g2, p0, lr)
    # heavy ball: t1 = g1, t2 = g2 + m*t1; update = -lr*t
    np.testing.assert_allclose(u1, -lr * g1, rtol=1e-6)
    np.testing.assert_allclose(u2, -lr * (g2 + m * g1), rtol=1e-6)
    # Nesterov: update = -lr*(g_k + m*t_k)
    n1, n2 = _two_steps(SGDM(momentum=m, nesterov=True), g1, g2, p0, lr)
    np.testing.assert_allclose(n1, -lr * (g1 + m * g1), rtol=1e-6)
    np.testing.assert_allclose(n2, -lr * (g2 + m * (g2 + m * g1)), rtol=1e-6)
    assert not np.allclose(n2, u2)


def test_sgdm_weight_decay_is_decoupled_from_momentum():
    """Decay is added after the momentum trace: each step decays by lr*wd*param, with no echo of
    earlier steps' decay (folding it into the gradient would give -lr*wd*(p1 + m*p0) at step 2)."""
    m, lr, wd = 0.9, 0.1, 0.5
    p0, zeros = np.array([2.0, -4.0]), np.zeros(2)
    u1, u2 = _two_steps(SGDM(momentum=m, weight_decay=wd), zeros, zeros, p0, lr)
    p1 = p0 + u1
    np.testing.assert_allclose(u1, -lr * wd * p0, rtol=1e-6)
    np.testing.assert_allclose(u2, -lr * wd * p1, rtol=1e-6)


def test_adamw_first_step_by_hand():
    """Bias-corrected Adam's first step is g/(|g|+eps); decoupled decay adds wd*p; times -lr."""
    lr, wd, eps = 0.1, 0.5, 1e-8
    g, p0 = np.array([0.3, -2.0, 1e-3]), np.array([1.0, 3.0, -3.0])
    u1, _ = _two_steps(AdamW(b1=0.9, b2=0.95, eps=eps, weight_decay=wd), g, g, p0, lr)
    np.testing.assert_allclose(u1, -lr * (g / (np.abs(g) + eps) + wd * p0), rtol=1e-5)


# --- knob checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, node, knob", [
    ("adamw", {"b1": 1.0}, "optimizer.b1"),
    ("adamw", {"b2": -0.1}, "optimizer.b2"),
    ("adamw", {"eps": 0.0}, "optimizer.eps"),
    ("adamw", {"weight_decay": -0.1}, "optimizer.weight_decay"),
    ("adamw", {"b1": "high"}, "optimizer.b1"),
    ("adamw", {"momentum": 0.9}, "optimizer.momentum"),  # an sgdm knob on adamw
    ("sgdm", {"momentum": 1.0}, "optimizer.momentum"),
    ("sgdm", {"weight_decay": -1.0}, "optimizer.weight_decay"),
    ("sgdm", {"nesterov": "yes"}, "optimizer.nesterov"),
])
def test_bad_optimizer_knobs_raise_config_error(name, node, knob):
    with pytest.raises(ConfigError, match=knob.replace(".", r"\.")):
        build_section(OPTIMIZERS[name], node, "optimizer")


def test_good_optimizer_knobs_are_typed():
    opt = build_section(OPTIMIZERS["adamw"], {"b1": 0, "weight_decay": 0, "nesterov": True}, "optimizer")
    assert opt == AdamW(b1=0.0, weight_decay=0.0, nesterov=True)
    assert isinstance(opt.b1, float)


@pytest.mark.parametrize("name, node, knob", [
    ("cosine", {"lr": 0.0}, "lr"),
    ("cosine", {"lr": 1.0, "warmup": -1}, "warmup"),
    ("linear", {"lr": 1.0, "const": -5}, "const"),
    ("trapezoid", {"lr": 1.0, "decay": -1}, "decay"),
    ("cosine", {"lr": 1.0, "max_steps": 0}, "max_steps"),
    ("piecewise_linear", {"lr": 1.0, "steps": [0, 10], "scales": [1.0]}, "steps"),
    ("piecewise_linear", {"lr": 1.0, "steps": [0, 10, 10], "scales": [1.0, 0.5, 0.1]}, "steps"),
    ("constant", {}, "lr"),  # lr is required
])
def test_bad_schedule_knobs_raise_config_error(name, node, knob):
    with pytest.raises(ConfigError, match=rf"optimizer\.lr_config\.{knob}"):
        build_section(SCHEDULES[name], node, "optimizer.lr_config")


def test_bad_optimizer_knob_fails_validation(tiny_run):
    with pytest.raises(ConfigError, match=r"optimizer\.b2"):
        tiny_run("optimizer.b2=1.5")
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        tiny_run("optimizer.name=lamb")
