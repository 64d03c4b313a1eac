"""optimizer/: weight decay (every optimizer, every group), clipping, SGD momentum against a
hand-written update, and the knob checks. Pure optax on tiny pytrees: no model runs. The
schedules are in test_schedules.py."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, optimizer_update, per_optimizer

from models.gpt import GPT, GPTConfig, param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer.adafactor import Adafactor
from optimizer.adamw import AdamW
from optimizer.sgdm import SGDM
from utils.config import build_section
from utils.errors import ConfigError

# Tolerances from float32 rounding (EPS32 = 2⁻²³ ≈ 1.19e-7: one rounding is ≤ EPS32/2 of the value) at
# the scale of the values compared, never one CPU's output.


def scale(x) -> float:
    """The largest magnitude in x: the scale a float32 computation's rounding is relative to."""
    return float(np.abs(np.asarray(x, np.float64)).max())


# --- weight decay masks ------------------------------------------------------------------------

CFG = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64, tie_embeddings=False)


def _params_and_labels():
    """Untied tiny GPT params with every leaf nonzero (fresh biases are 0: decay would not show)."""
    model = eqx.filter_eval_shape(GPT, CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)  # NumPy, not jax.random: no per-shape compilation
    params = jax.tree.map(lambda x: jnp.asarray(1.0 + rng.uniform(size=x.shape), jnp.float32), model)
    return params, param_labels(model)


def _first_update(tx, grads, params, hparams=None):
    """One jitted init + update (eager optax compiles every small op separately: much slower);
    `hparams`: what tx was built from (helpers.optimizer_update)."""
    return jax.jit(lambda g, p: optimizer_update(tx, g, tx.init(p), p, hparams)[0])(grads, params)


def _expected_decay(path, decay_embeddings: bool) -> bool:
    """Independent of optimizer.groups: block matrices and the untied head, embeddings if asked."""
    names = [p.name for p in path]
    if names[0] == "blocks":
        return names[-1] == "weight_IxO"
    if names[0] in ("wte_VxD", "wpe_TxD"):
        return decay_embeddings
    return names[0] == "head_DxV"


# Every optimizer with the default decay_embeddings=false; true (embeddings decayed, through a
# different transform under Muon) on two, to keep the compile count down.
@pytest.mark.parametrize(("name", "decay_embeddings"), per_optimizer(
    [(name, False) for name in sorted(OPTIMIZERS)] + [("adamw", True), ("muon", True)]))
def test_weight_decay_is_decoupled_and_times_the_group_lr_for_every_optimizer(name, decay_embeddings):
    """One step on a zero gradient, so only the decay moves anything: a decayed weight becomes
    w·(1 − lr·weight_decay) with lr the group's scheduled lr, the same for every optimizer
    (optax.adafactor's own decay ignores the lr: w·(1 − weight_decay)); biases, norm gains and
    undecayed embeddings stay put. Zero gradients also meet the 0/0 normalisations (Muon's
    Newton–Schulz, Adafactor's RMS clipping, Shampoo's grafting): all must stay finite.
    "Put" is within 2 float32 roundings: Schedule-Free rebuilds the weights as b1·x + (1 − b1)·z
    with x = z = w here (two products and a sum, each rounded: ≤ 1.5 ulp); the smallest decay
    moves a leaf by 0.4·0.125·0.1 = 5e-3, 40000× more. Prodigy's decay is times its learned step
    d·lr (optimizer/prodigy.py), and on zero gradients d is 0/0: it takes no step at all, as the
    authors' code (its decay is checked against pytorch_optimizer's, tests/test_parity_adopt_prodigy_normuon.py)."""
    wd = 0.1
    opt = dataclasses.replace(OPTIMIZERS[name](), weight_decay=wd, decay_embeddings=decay_embeddings)
    params, labels = _params_and_labels()
    peak = {"hidden": 0.5, "embed": 0.25, "head": 0.125, "scalar": 0.2}  # distinct: a mixed-up group shows
    warmup = optax.linear_schedule(0.2, 1.0, 10)  # step 0 runs at 0.4 of each group's peak (base lr 0.5)
    tx = make_optimizer(opt, warmup, labels, 1.0, 0.5, {g: {"lr": lr} for g, lr in peak.items()})
    updates = _first_update(tx, jax.tree.map(jnp.zeros_like, params), params, opt)
    new_params = optax.apply_updates(params, updates)

    decayed = []
    leaves = zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new_params), jax.tree.leaves(labels))
    for (path, p), p_new, label in leaves:
        leaf = f"{name}: " + ".".join(k.name for k in path)
        assert np.all(np.isfinite(p_new)), leaf
        if _expected_decay(path, decay_embeddings):
            decayed.append(leaf)
            if name == "prodigy":
                np.testing.assert_array_equal(p_new, p, err_msg=leaf)
                continue
            # p ∈ [1, 2): one ulp is EPS32 of it. p − lr·wd·p rounds once (the product, ≤ 0.02·p, adds
            # 0.02 of an ulp per rounding of lr, wd and their product), Schedule-Free's rebuild ≤ 1.5 ulp
            # more: ≤ 2.5 EPS32 of p at worst, ~3x margin.
            np.testing.assert_allclose(p_new, p * (1 - 0.4 * peak[label] * wd), rtol=8 * EPS32, err_msg=leaf)
        else:
            np.testing.assert_allclose(p_new, p, rtol=2 * EPS32, atol=0, err_msg=leaf)
    n_embed = 2 if decay_embeddings else 0
    assert len(decayed) == 4 + 1 + n_embed  # four block matrices, the head, the embeddings if asked


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_adafactor_without_decay_is_optax_adafactor(momentum):
    """Rebuilt from optax's pieces for the decay's sake, the rest must still be optax.adafactor
    (factored above 128 on both sides, RMS clipping, optional momentum) under a constant lr."""
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.normal(size=(2, 130, 140)), jnp.float32), "b": jnp.ones((7,), jnp.float32)}
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    ours = Adafactor(b1=momentum).transform("hidden", optax.constant_schedule(0.01))
    reference = optax.adafactor(0.01, momentum=momentum, multiply_by_parameter_scale=False)

    def three_updates(tx):
        def run(grads_seq, params):
            state, out = tx.init(params), []
            for g in grads_seq:
                u, state = tx.update(g, state, params)
                out.append(u)
            return out

        return jax.jit(run)(grads_seq, params)

    for a, b in zip(jax.tree.leaves(three_updates(ours)), jax.tree.leaves(three_updates(reference)), strict=True):
        # The same float32 operations on the same shapes in two programs, which XLA may fuse (and so
        # round) differently: 10 roundings of the leaf's scale per update, 3 updates (as
        # test_optax_backed's _tolerance). A wrong decay rate, clip or factoring moves it by far more.
        np.testing.assert_allclose(a, b, rtol=0, atol=10 * 3 * EPS32 * scale(b))


# --- clipping ----------------------------------------------------------------------------------


def _random_grads(params, norm: float, seed=2):
    rng = np.random.default_rng(seed)
    g = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
    scale = norm / np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
    return jax.tree.map(lambda x: jnp.asarray(x * scale, jnp.float32), g)


def _clip_rtol(params) -> float:
    """A clipped update against the same gradients scaled in float32, relative to each element (no
    decay: every element is its gradient times factors). The clip's factor 2/‖g‖ comes from a float32 sum
    of n squares (~√n·EPS32/2 of it, halved by the square root); the rest is ≤ 8 roundings of EPS32/2
    per side (the reference's × 0.2; AdamW's moments, corrections, square root, division): 2x margin."""
    n = sum(x.size for x in jax.tree.leaves(params))
    return 2 * (math.sqrt(n) * EPS32 / 4 + 2 * 8 * EPS32 / 2)


@pytest.mark.parametrize("opt", [SGDM(momentum=0.9), AdamW(eps=1.0, weight_decay=0.0)], ids=["sgdm", "adamw"])
def test_clipping_by_global_norm(opt):
    """SGDM is linear in the gradient and AdamW with a large eps nearly so, so a missing or wrong
    clip shows up in the update (plain Adam's first step is scale-invariant and would hide it)."""
    params, labels = _params_and_labels()
    lr = 0.1

    def first_update(grads, clip):
        return _first_update(make_optimizer(opt, optax.constant_schedule(lr), labels, clip), grads, params, opt)

    big = _random_grads(params, 10.0)
    clipped = first_update(big, clip=2.0)
    reference = first_update(jax.tree.map(lambda g: g * 0.2, big), clip=None)  # the same grads at norm 2
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=_clip_rtol(params), atol=0)
    unclipped = first_update(big, clip=None)
    # "differs": the clip scales by far more than 1e-3 here, and rounding moves it by ~EPS32, far less
    assert not np.allclose(jax.tree.leaves(clipped)[0], jax.tree.leaves(unclipped)[0], rtol=1e-3)

    # Below the clip (and clip 0) the gradients pass through unchanged: both sides are the same per-element
    # operations, which two programs may fuse (round) differently: AdamW's ≤ 8 roundings of EPS32/2 (the
    # moments, their bias corrections, the square root, + eps, the division, × lr) on each side.
    same = 8 * EPS32
    small = _random_grads(params, 1.5)  # below the clip: untouched
    for a, b in zip(jax.tree.leaves(first_update(small, clip=2.0)), jax.tree.leaves(first_update(small, clip=None))):
        np.testing.assert_allclose(a, b, rtol=same, atol=0)
    # clip 0 means off (train.gradient_clip_val: "null or 0 = off").
    for a, b in zip(jax.tree.leaves(first_update(big, clip=0.0)), jax.tree.leaves(unclipped)):
        np.testing.assert_allclose(a, b, rtol=same, atol=0)


def test_sgdm_clipped_update_by_hand():
    params, labels = _params_and_labels()
    big = _random_grads(params, 10.0)
    tx = make_optimizer(SGDM(momentum=0.9), optax.constant_schedule(0.1), labels, 2.0)
    updates = _first_update(tx, big, params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(big)):
        np.testing.assert_allclose(u, -0.1 * g * (2.0 / 10.0), rtol=_clip_rtol(params), atol=0)


# --- SGD with momentum by hand -------------------------------------------------------------------


def _two_steps(opt, g1, g2, p0, lr=0.1):
    params, labels = {"w": p0}, {"w": "hidden"}
    tx = make_optimizer(opt, optax.constant_schedule(lr), labels, None)
    state = tx.init(params)
    u1, state = tx.update({"w": g1}, state, params)
    params = optax.apply_updates(params, u1)
    u2, state = tx.update({"w": g2}, state, params)
    return np.asarray(u1["w"]), np.asarray(u2["w"])


def _roundings(k: int, magnitude) -> np.ndarray:
    """k float32 roundings, each ≤ EPS32/2 of the magnitude of the terms they act on, 2x margin: an
    atol per element (a cancelling sum's error is relative to its terms, not to the sum)."""
    return k * EPS32 * np.abs(magnitude)


def _assert_within(actual, expected, atol):
    """|actual − expected| ≤ atol elementwise (atol an array: np.testing.assert_allclose takes a scalar)."""
    err = np.abs(np.asarray(actual, np.float64) - expected)
    assert np.all(err <= atol), f"|error| {err} > {atol}: {actual} vs {expected}"


def test_sgdm_matches_hand_computed_momentum():
    m, lr = 0.9, 0.1
    g1, g2, p0 = np.array([1.0, -2.0, 0.5]), np.array([0.5, 1.0, -1.0]), np.array([1.0, 1.0, 1.0])
    u1, u2 = _two_steps(SGDM(momentum=m), g1, g2, p0, lr)
    # heavy ball: t1 = g1, t2 = g2 + m*t1; update = -lr*t. The g's are exact in float32; m·t + g rounds
    # m, the product and the sum (3); × -lr rounds lr, the group's factor on it and the product (3).
    _assert_within(u1, -lr * g1, _roundings(3, lr * g1))
    _assert_within(u2, -lr * (g2 + m * g1), _roundings(6, lr * (abs(g2) + m * abs(g1))))
    # Nesterov: update = -lr*(g_k + m*t_k), one more m·t + g (3 roundings) of those magnitudes
    n1, n2 = _two_steps(SGDM(momentum=m, nesterov=True), g1, g2, p0, lr)
    _assert_within(n1, -lr * (g1 + m * g1), _roundings(6, lr * (1 + m) * g1))
    _assert_within(n2, -lr * (g2 + m * (g2 + m * g1)),
                   _roundings(9, lr * (abs(g2) + m * (abs(g2) + m * abs(g1)))))
    assert not np.allclose(n2, u2)


def test_sgdm_weight_decay_is_decoupled_from_momentum():
    """Decay is added after the momentum trace: each step decays by lr*wd*param, with no echo of
    earlier steps' decay (folding it into the gradient would give -lr*wd*(p1 + m*p0) at step 2)."""
    m, lr, wd = 0.9, 0.1, 0.5
    p0, zeros = np.array([2.0, -4.0]), np.zeros(2)
    u1, u2 = _two_steps(SGDM(momentum=m, weight_decay=wd), zeros, zeros, p0, lr)
    p1 = p0 + u1  # float64: the optimizer's p1 is this rounded once more (apply_updates)
    # wd·p (wd's value, the product: 2 roundings), then × -lr (3); p1's rounding: 1 more at step 2.
    _assert_within(u1, -lr * wd * p0, _roundings(5, lr * wd * p0))
    _assert_within(u2, -lr * wd * p1, _roundings(6, lr * wd * p1))


def _bias_correction_error(b: float) -> float:
    """Relative error of a first-step bias correction (1 − b)/(1 − b^1) in float32: optax rounds 1 − b
    (EPS32/2) but divides by 1 − float32(b), off from 1 − b by float32(b)'s rounding."""
    return abs(float(np.float32(b)) - b) / (1 - b) + EPS32 / 2


def test_adamw_first_step_by_hand():
    """Bias-corrected Adam's first step is g/(|g|+eps); decoupled decay adds wd*p; times -lr."""
    lr, wd, eps, b1, b2 = 0.1, 0.5, 1e-8, 0.9, 0.95
    g, p0 = np.array([0.3, -2.0, 1e-3]), np.array([1.0, 3.0, -3.0])
    u1, _ = _two_steps(AdamW(b1=b1, b2=b2, eps=eps, weight_decay=wd), g, g, p0, lr)
    direction = g / (np.abs(g) + eps)
    # The direction: m̂'s bias correction, v̂'s halved by the square root, and ≤ 8 roundings (g², the
    # moments' products, √, + eps, the division): relative to it, 2x margin. Then wd·p (2 roundings), the
    # sum (1) and × -lr (3), relative to the terms' magnitude |direction| + wd·|p|.
    direction_err = 2 * (_bias_correction_error(b1) + _bias_correction_error(b2) / 2 + 8 * EPS32 / 2)
    atol = lr * direction_err * np.abs(direction) + _roundings(6, lr * (np.abs(direction) + wd * np.abs(p0)))
    _assert_within(u1, -lr * (direction + wd * p0), atol)


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


def test_bad_optimizer_knob_fails_validation(tiny_run):
    with pytest.raises(ConfigError, match=r"optimizer\.b2"):
        tiny_run("optimizer.b2=1.5")
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        tiny_run("optimizer.name=lamb")
