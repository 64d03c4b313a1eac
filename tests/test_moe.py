"""Mixture-of-Experts (models/moe.py): the router losses and the routing against NumPy, the drop rule
of capacity routing on constructed cases, the MoE model against a dense one, training steps with the
moe/* metrics, and the one-line errors of bad knobs; the same for llama's SwiGLU experts; Muon (and
Shampoo, SOAP) on expert-stacked (L, E, D, F) weights: one matrix per (D, F).

Tolerances (RTOL): float32 rounding (EPS32 = 2⁻²³ ≈ 1.19e-7) at the values' scale. The longest sums
here are the tiny GPT's 128-term MLP dot products (the MoE layers' own are ≤ 16 terms) and means over
≤ 64 tokens: ~(√128 + √64)·EPS32 of their terms' scale per computation; float32 against a float64
reference (or a second float32 path), 4x margin: ≈ 9.2e-6. Outputs that can be near 0 are compared with
an absolute tolerance of RTOL times their largest magnitude."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import background
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, ShardedCheck, compose_config

import models
import train_jax as T
from models import hf, llama, losses, mdlm
from models.gpt import GPT, Block, GeluExperts, GPTConfig
from models.layers import Linear
from models.moe import MoE, MoEConfig, routing
from optimizer import OPTIMIZERS
from optimizer.diagnostics import find_states
from optimizer.muon import Muon, MuonState
from trainer import step_metrics
from utils.config import validate
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

RTOL = 4 * (math.sqrt(128) + math.sqrt(64)) * EPS32  # see the module docstring
# The sharded steps' losses: means over 2·8·16 = 256 tokens, two meshes (tests/test_train_step.py's SHARDED_RTOL).
SHARDED_RTOL = 4 * math.sqrt(256) * EPS32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = GPTConfig(vocab_size=64, context_length=16, dim=32, num_heads=2, num_blocks=4)
LCFG = llama.LlamaConfig(vocab_size=64, context_length=16, dim=32, num_heads=4, num_kv_heads=2, num_blocks=4,
                         mlp_multiple=32)  # SwiGLU width 96
LLAMA = ("model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2")  # at helpers.TINY_OVERRIDES' shape


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def np_gelu(x):  # the tanh approximation, jax.nn.gelu(approximate=True)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def test_router_losses_match_numpy():
    rng = np.random.default_rng(0)
    N, E, K = 64, 8, 2
    logits = rng.normal(0, 2.0, (N, E)).astype(np.float32)
    stats = routing(jnp.asarray(logits), K, None, True).stats
    z = logits.astype(np.float64)
    p = np_softmax(z)
    top = np.argsort(-p, axis=-1)[:, :K]
    f = np.bincount(top.reshape(-1), minlength=E) / (N * K)  # fraction of token-slots per expert
    want_balance = E * np.sum(f * p.mean(0))
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    np.testing.assert_allclose(float(stats["load_balance"]), want_balance, rtol=RTOL)
    np.testing.assert_allclose(float(stats["z_loss"]), np.mean(lse**2), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(stats["load"]), f, rtol=RTOL)
    assert float(stats["dropped"]) == 0.0
    # A router that sends everything to one expert with certainty scores E: the loss's range is [1, E].
    collapsed = routing(jnp.asarray(np.tile([50.0] + [0.0] * (E - 1), (N, 1)).astype(np.float32)), 1, None, True)
    np.testing.assert_allclose(float(collapsed.stats["load_balance"]), E, rtol=RTOL)


def test_capacity_drops_later_choices_then_later_positions():
    """E=2, k=2, C=2: token t's first choice is expert [0, 0, 1][t], its second the other. Expert 0's
    slots in priority order: t0, t1 (first choices), t2 (second) -> t2's second choice is dropped;
    expert 1's: t2 (first), t0, t1 (second) -> t1's second is dropped. Position order alone would
    drop t2's first choice instead."""
    logits = jnp.asarray([[2.0, 1.0], [2.0, 1.0], [1.0, 2.0]])
    route = routing(logits, 2, MoEConfig(num_experts=2, top_k=2, capacity_factor=2 / 3).capacity(3), True)
    assert route.capacity == 2
    np.testing.assert_array_equal(np.asarray(route.expert_NxK), [[0, 1], [0, 1], [1, 0]])
    np.testing.assert_array_equal(np.asarray(route.kept_NxK), [[True, True], [True, False], [True, False]])
    np.testing.assert_allclose(float(route.stats["dropped"]), 2 / 6, rtol=RTOL)


def random_layer(key, D: int, F: int, E: int) -> MoE:
    k_r, k_in, k_bi, k_out, k_bo = jax.random.split(key, 5)
    normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
    experts = GeluExperts(Linear(normal(k_in, (E, D, F), 0.3), normal(k_bi, (E, F), 0.3)),
                          Linear(normal(k_out, (E, F, D), 0.3), normal(k_bo, (E, D), 0.3)))
    return MoE(router=Linear(normal(k_r, (D, E), 1.0), None), experts=experts)


def gelu_expert(w, e: int, x: np.ndarray) -> np.ndarray:
    """Expert e of GeluExperts `w` (float64 arrays) on one token."""
    h = np_gelu(x @ w.mlp_in.weight_IxO[e] + w.mlp_in.bias_O[e])
    return h @ w.mlp_out.weight_IxO[e] + w.mlp_out.bias_O[e]


def reference(layer: MoE, x_NxD: np.ndarray, cfg: MoEConfig, kept_NxK=None, expert=gelu_expert) -> np.ndarray:
    """Token by token in float64: the top-k experts' MLPs (`expert(weights, e, x)`) weighted by their
    (renormalised) router probabilities; a slot not in `kept_NxK` contributes nothing."""
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), layer)
    out = np.zeros_like(x_NxD, dtype=np.float64)
    for n, x in enumerate(x_NxD.astype(np.float64)):
        p = np_softmax(x @ w.router.weight_IxO)
        top = np.argsort(-p, kind="stable")[: cfg.top_k]
        gates = p[top] / p[top].sum() if cfg.renormalize else p[top]
        for k, (e, g) in enumerate(zip(top, gates, strict=True)):
            if kept_NxK is not None and not kept_NxK[n, k]:
                continue
            out[n] += g * expert(w.experts, e, x)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_routing_equals_a_per_token_reference(renormalize, capacity_factor):
    """Dropless: every token's top-k experts, weighted as Mixtral (renormalised) or Switch (raw).
    With capacity 0.5 about half the slots are dropped and exactly those contribute nothing."""
    B, T, D, F, E = 2, 12, 8, 16, 4
    cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=capacity_factor, renormalize=renormalize)
    layer = random_layer(jax.random.PRNGKey(0), D, F, E)
    x_BxTxD = jax.random.normal(jax.random.PRNGKey(1), (B, T, D), jnp.float32)
    y_BxTxD, stats = jax.jit(MoE.__call__, static_argnums=2)(layer, x_BxTxD, cfg)
    kept = None
    if capacity_factor is not None:
        x_NxD = x_BxTxD.reshape(B * T, D)
        route = routing(x_NxD @ layer.router.weight_IxO, 2, cfg.capacity(B * T), renormalize)
        kept = np.asarray(route.kept_NxK)
        assert 0.2 < float(stats["dropped"]) == 1 - kept.mean() < 0.8  # the case really drops slots
    want = reference(layer, np.asarray(x_BxTxD).reshape(B * T, D), cfg, kept)
    got = np.asarray(y_BxTxD).reshape(B * T, D)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    if kept is not None:
        assert np.all(got[~kept.any(1)] == 0.0)  # a token with every slot dropped: exactly zero


def test_capacity_with_room_for_everything_equals_dropless():
    """The two dispatches (slots + einsum, sorted rows + ragged_dot) agree when nothing is dropped."""
    layer = random_layer(jax.random.PRNGKey(2), 8, 16, 4)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 8), jnp.float32)
    call = jax.jit(MoE.__call__, static_argnums=2)
    dropless, _ = call(layer, x, MoEConfig(num_experts=4, top_k=2))
    roomy, stats = call(layer, x, MoEConfig(num_experts=4, top_k=2, capacity_factor=2.0))  # C = N
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(np.asarray(roomy), np.asarray(dropless), rtol=RTOL,
                               atol=RTOL * float(jnp.abs(dropless).max()))


@pytest.mark.parametrize("every", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_one_expert_top1_is_the_dense_model(every):
    """E=1, k=1, dropless: the router's weight is 1 for every token, so each MoE block is its dense
    MLP; with every=2 blocks 1 and 3 are MoE and blocks 0 and 2 dense, in that order."""
    cfg = dataclasses.replace(CFG, moe=MoEConfig(num_experts=1, top_k=1, every=every))
    moe_model = GPT(cfg, jax.random.PRNGKey(0))
    dense = GPT(CFG, jax.random.PRNGKey(1))
    moe_layers = cfg.moe.layers(cfg.num_blocks)
    assert moe_layers == ((0, 1, 2, 3) if every == 1 else (1, 3))
    # The per-block view (every leaf (num_blocks, ...)): one stack, or the dense and MoE stacks
    # padded with zeros into their blocks' places, so adding them gives each block's weights.
    view = models.blocks(moe_model)
    parts = (view,) if every == 1 else view
    add = lambda *trees: jax.tree.map(lambda *a: sum(a), *trees)
    fields = {f: add(*[getattr(p, f) for p in parts]) for f in ("ln1", "attn_qkv", "attn_out", "ln2")}
    expert0 = jax.tree.map(lambda a: a[:, 0], parts[-1].moe.experts)  # the one expert of each MoE block
    for f in ("mlp_in", "mlp_out"):
        fields[f] = getattr(expert0, f) if every == 1 else add(getattr(parts[0], f), getattr(expert0, f))
    dense = eqx.tree_at(lambda m: (m.blocks, m.wte_VxD, m.wpe_TxD, m.ln_f), dense,
                        (Block(**fields), moe_model.wte_VxD, moe_model.wpe_TxD, moe_model.ln_f))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 64)
    want = np.asarray(jax.jit(GPT.__call__)(dense, tokens))
    got, stats = jax.jit(functools.partial(GPT.__call__, collect=True))(moe_model, tokens)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    assert stats["moe"]["load"].shape == (len(moe_layers), 1) and stats["resid"].shape == (4,)


def test_flops_count_the_active_experts_and_the_router():
    cfg = dataclasses.replace(CFG, moe=MoEConfig(num_experts=8, top_k=2, every=2))
    d, f, L, V, T = 32, 128, 4, 64, 16
    dense = 6 * (L * (4 * d * d + 2 * d * f) + d * V) + 12 * L * d * T
    assert models.flops_per_token(CFG, T) == dense
    # two MoE blocks, each: one more MLP (top_k=2 instead of 1) and the router's d x E
    assert models.flops_per_token(cfg, T) == dense + 6 * 2 * (2 * d * f + d * 8)


def run_steps(*overrides: str, steps: int = 8):
    run = validate(compose_config("model.moe.num_experts=4", "optimizer=adamw", "optimizer/lr_config=constant",
                                  "optimizer.lr_config.lr=3e-3", "optimizer.lr_config.warmup=0", *overrides))
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch = meshlib.put_batch(np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32),
                              meshlib.batch_sharding(mesh, 1))
    history = []
    for _ in range(steps):
        state, metrics = step(state, batch, True)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def test_training_steps_lower_the_loss_and_log_the_router():
    """gpt_tiny's shape cut down (helpers.TINY_OVERRIDES) with 4 experts, top-2, capacity 1.0 and
    logging.per_layer: the loss falls on a repeated batch and every moe/* metric is logged."""
    _, history = run_steps("model.moe.capacity_factor=1.0")
    first, last = history[0], history[-1]
    assert last["train/loss"] < first["train/loss"] - 0.1
    assert 1.0 <= first["moe/load_balance_loss"] <= 4.0 and first["moe/router_z_loss"] > 0
    assert 0.0 <= first["moe/dropped_fraction"] < 1.0
    for layer in (0, 1):  # both blocks are MoE (every=1)
        assert 0.0 <= first[f"moe/load/{layer}/min"] <= 0.25 <= first[f"moe/load/{layer}/max"] <= 1.0


def test_per_layer_logs_every_experts_load():
    """logging.per_layer: moe/load/<block>/<expert>, averaged over micro-batches, on logging steps only."""
    load_AxE = jnp.asarray([[0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.3, 0.2]])
    metric = step_metrics.expert_loads()
    assert metric.logging_only
    values = metric.fn(None, None, None, {"moe": {"load": {"3": load_AxE}}})
    assert {k: round(float(v), 6) for k, v in values.items()} == {
        "moe/load/3/0": 0.2, "moe/load/3/1": 0.2, "moe/load/3/2": 0.3, "moe/load/3/3": 0.3}
    aux = {"moe": {"load": {"3": load_AxE}, **{name: jnp.ones(2) for name in
                                               ("load_balance_loss", "router_z_loss", "dropped_fraction")}}}
    summary = step_metrics.router(None, None, None, aux)
    assert (float(summary["moe/load/3/min"]), float(summary["moe/load/3/max"])) == pytest.approx((0.2, 0.3))
    assert step_metrics.router(None, None, None, {"loss": jnp.ones(1)}) == {} == metric.fn(None, None, None, {})
    run = validate(compose_config("model.moe.num_experts=2", "logging.log_callback_data=true",
                                  "logging.per_layer=true"))
    labels = models.param_labels(models.abstract(dataclasses.replace(run.model, vocab_size=64)))
    assert [m for m in T.default_metrics(run, lambda s: 1e-3, labels)
            if getattr(getattr(m, "fn", None), "__name__", "") == "expert_load_vectors"]


@pytest.mark.parametrize("objective", ["ar", pytest.param("mdlm", marks=pytest.mark.slow)])
def test_router_losses_enter_the_training_loss_and_only_it(objective):
    """Both objectives' training loss = their LM loss + coefficients x the router losses (mean over
    the MoE layers); aux["loss"] (train/loss) is the LM loss alone, and a dense model's aux has no
    router. Same weights under coefficients 0 and (3, 5): the totals differ by exactly that sum."""
    loss_fn = {"ar": losses.loss_fn, "mdlm": functools.partial(mdlm.loss_fn, eps=1e-3)}[objective]
    tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 17), 0, 63)
    key = jax.random.PRNGKey(3)
    out = {}
    for coefs in ((0.0, 0.0), (3.0, 5.0)):
        moe = MoEConfig(num_experts=4, top_k=2, every=2, load_balance_coef=coefs[0], z_loss_coef=coefs[1])
        model = GPT(dataclasses.replace(CFG, num_blocks=2, moe=moe), jax.random.PRNGKey(0))
        out[coefs] = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=3)(model, tokens, key,
                                                                                             jnp.float32)
    (total0, aux0), grads0 = out[(0.0, 0.0)]
    (total1, aux1), grads1 = out[(3.0, 5.0)]
    assert float(total0) == float(aux0["loss"]) and float(aux1["loss"]) == float(aux0["loss"])
    router = 3.0 * float(aux1["moe"]["load_balance_loss"]) + 5.0 * float(aux1["moe"]["router_z_loss"])
    np.testing.assert_allclose(float(total1) - float(total0), router, rtol=RTOL)
    assert set(aux1["moe"]["load"]) == {"1"}  # every=2: block 1 is MoE, block 0 dense
    g0, g1 = (np.asarray(g.blocks.moe.moe.router.weight_IxO) for g in (grads0, grads1))
    assert np.abs(g1 - g0).max() > 1e-3 * np.abs(g0).max()  # the router losses reach the router
    dense = GPT(dataclasses.replace(CFG, num_blocks=2), jax.random.PRNGKey(0))
    assert set(jax.jit(loss_fn, static_argnums=3)(dense, tokens, key, jnp.float32)[1]) == {"loss", "correct"}


def test_per_expert_axes_for_the_layout():
    axes = models.param_axes(models.abstract(CFG))
    assert axes.blocks.mlp_in.weight_IxO == ("layers", "embed", "mlp")  # dense: as always
    moe_axes = models.param_axes(models.abstract(dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, every=2))))
    assert moe_axes.blocks.moe.moe.experts.mlp_in.weight_IxO == ("layers", "expert", "embed", "mlp")
    assert moe_axes.blocks.moe.moe.experts.mlp_out.bias_O == ("layers", "expert", "embed")
    assert moe_axes.blocks.moe.moe.router.weight_IxO == ("layers", "embed", "router")
    assert moe_axes.blocks.dense.mlp_in.weight_IxO == ("layers", "layers", "embed", "mlp")


@pytest.mark.parametrize(("overrides", "knob"), [
    (("model.moe.num_experts=4", "model.moe.top_k=5"), "model.moe.top_k=5"),
    (("model.moe.num_experts=4", "model.moe.capacity_factor=0"), "model.moe.capacity_factor=0"),
    (("model.moe.num_experts=4", "model.moe.every=3"), "model.moe.every=3"),
    (("model.moe.num_experts=3", "parallel.expert=2"), "parallel.expert=2"),
    (("parallel.expert=2",), "parallel.expert=2"),
    ((*LLAMA, "model.moe.num_experts=4", "model.moe.top_k=5"), "model.moe.top_k=5"),
    ((*LLAMA, "model.moe.num_experts=4", "model.moe.every=3"), "model.moe.every=3"),
    (("model.moe.num_experts=2", "model.lora.rank=4"), "model.lora.rank=4 with model.moe.num_experts=2"),
    ((*LLAMA, "model.moe.num_experts=2", "model.lora.rank=4"), "model.lora.rank=4 with model.moe.num_experts=2"),
])
def test_bad_moe_knobs_are_one_line_errors(overrides, knob):
    with pytest.raises(ConfigError, match=knob.replace(".", r"\.")) as e:
        validate(compose_config(*overrides))
    assert "\n" not in str(e.value)


@background.setup
def moe_sharded_check(ctx) -> ShardedCheck:
    return ShardedCheck(ctx.tmp_path_factory.mktemp("moe_sharded"), ctx.tmp_path_factory.mktemp("moe_cache"),
                        ("--moe",))


@pytest.mark.slow
def test_expert_parallel_on_8_devices_equals_1_device(moe_sharded_check):
    """tests/sharded_step_check.py --moe: 3 steps of 2 micro-batches with 4 experts, capacity routing
    on data 2 x expert 2 x fsdp 2 and dropless routing (every second block MoE) on expert 2 x fsdp 2
    x tensor 2, against 1 device (tests/test_train_step.py's tolerance, SHARDED_RTOL: the same global
    computation, only float summation order differs). The experts' axis is split over `expert`."""
    r = moe_sharded_check.result()
    assert r["devices"] == 8
    assert r["capacity"]["mesh"] == {"data": 2, "expert": 2, "fsdp": 2, "tensor": 1}
    assert r["dropless"]["mesh"] == {"data": 1, "expert": 2, "fsdp": 2, "tensor": 2}
    for case in ("capacity", "dropless"):
        c = r[case]
        np.testing.assert_allclose(c["losses_8"], c["losses_1"], rtol=SHARDED_RTOL, err_msg=case)
        assert c["params_allclose"] and c["kept"] and c["params_moved"] > 1e-3, (case, c["max_param_diff"])
        assert c["specs"]["experts_in"][:2] == ["None", "expert"] and "expert" not in c["specs"]["router"], case
    assert r["dropless"]["specs"]["experts_in"] == ["None", "expert", "fsdp", "tensor"]


# ----------------------------------------------------------------------------- llama: SwiGLU experts


def np_silu(x):
    return x / (1 + np.exp(-x))


def swiglu_expert(w, e: int, x: np.ndarray) -> np.ndarray:
    """Expert e of SwiGLUExperts `w` (float64 arrays, no biases) on one token."""
    h = np_silu(x @ w.gate_proj.weight_IxO[e]) * (x @ w.up_proj.weight_IxO[e])
    return h @ w.down_proj.weight_IxO[e]


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_llama_routing_equals_a_per_token_swiglu_reference(capacity_factor):
    """Llama's experts (gate, up, down stacked on a leading expert axis) through both dispatches, against
    the float64 per-token reference; capacity 0.5 drops about half the slots."""
    B, T, D, F, E = 2, 12, 8, 16, 4
    cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=capacity_factor)
    k_r, k_g, k_u, k_d = jax.random.split(jax.random.PRNGKey(4), 4)
    normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
    experts = llama.SwiGLUExperts(Linear(normal(k_g, (E, D, F), 0.3), None), Linear(normal(k_u, (E, D, F), 0.3), None),
                                  Linear(normal(k_d, (E, F, D), 0.3), None))
    layer = MoE(router=Linear(normal(k_r, (D, E), 1.0), None), experts=experts)
    x_BxTxD = jax.random.normal(jax.random.PRNGKey(5), (B, T, D), jnp.float32)
    y_BxTxD, stats = jax.jit(MoE.__call__, static_argnums=2)(layer, x_BxTxD, cfg)
    x_NxD = x_BxTxD.reshape(B * T, D)
    kept = None
    if capacity_factor is not None:
        kept = np.asarray(routing(x_NxD @ layer.router.weight_IxO, 2, cfg.capacity(B * T), True).kept_NxK)
        assert 0.2 < float(stats["dropped"]) < 0.8
    want = reference(layer, np.asarray(x_NxD), cfg, kept, swiglu_expert)
    np.testing.assert_allclose(np.asarray(y_BxTxD).reshape(B * T, D), want, rtol=RTOL, atol=RTOL * np.abs(want).max())


@pytest.mark.parametrize("every", [1, 2])
def test_llama_one_expert_top1_is_the_dense_llama(every):
    """E=1, k=1, dropless: each MoE block computes its dense SwiGLU MLP (the router's weight is 1), so
    the MoE llama equals a dense llama holding the same weights; with every=2 blocks 1 and 3 are MoE."""
    cfg = dataclasses.replace(LCFG, moe=MoEConfig(num_experts=1, top_k=1, every=every))
    moe_model = llama.Llama(cfg, jax.random.PRNGKey(0))
    view = models.blocks(moe_model)
    parts = (view,) if every == 1 else view
    add = lambda *trees: jax.tree.map(lambda *a: sum(a), *trees)
    expert0 = jax.tree.map(lambda a: a[:, 0], parts[-1].moe.experts)  # the one expert of each MoE block
    fields = {}
    for field in (f.name for f in dataclasses.fields(llama.Block)):
        if field in ("gate_proj", "up_proj", "down_proj"):
            fields[field] = getattr(expert0, field) if every == 1 else add(getattr(parts[0], field),
                                                                             getattr(expert0, field))
        else:
            fields[field] = add(*[getattr(p, field) for p in parts])
    dense = eqx.tree_at(lambda m: m.blocks, llama.Llama(LCFG, jax.random.PRNGKey(1)), llama.Block(**fields))
    dense = eqx.tree_at(lambda m: m.embed_VxD, dense, moe_model.embed_VxD)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 64)
    want = np.asarray(jax.jit(llama.Llama.__call__)(dense, tokens))
    got, stats = jax.jit(functools.partial(llama.Llama.__call__, collect=True))(moe_model, tokens)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    assert stats["moe"]["load"].shape == (len(cfg.moe.layers(4)), 1) and stats["resid"].shape == (4,)


def test_llama_moe_flops_axes_and_hugging_face_refusals(tmp_path):
    """FLOPs: each MoE block counts top_k SwiGLU experts (3·d·f each) and the router (d·E). Axes: the
    experts get `expert` after the stacked axes, the router its own. Export refuses a llama MoE that no
    Hugging Face MoE type holds (tests/test_hf_moe.py: the ones that do) and any GPT MoE; init_from
    refuses MoE blocks from a dense directory."""
    cfg = dataclasses.replace(LCFG, moe=MoEConfig(num_experts=8, top_k=2, every=2))
    d, f = 32, 96
    assert models.flops_per_token(cfg, 16) == models.flops_per_token(LCFG, 16) + 6 * 2 * (3 * d * f + d * 8)
    axes = models.param_axes(models.abstract(cfg))
    assert axes.blocks.moe.moe.experts.gate_proj.weight_IxO == ("layers", "expert", "embed", "mlp")
    assert axes.blocks.moe.moe.experts.down_proj.weight_IxO == ("layers", "expert", "mlp", "embed")
    assert axes.blocks.moe.moe.router.weight_IxO == ("layers", "embed", "router")
    assert axes.blocks.dense.up_proj.weight_IxO == ("layers", "layers", "embed", "mlp")
    assert axes.blocks.moe.q_proj.weight_IxO == ("layers", "embed", "heads")
    assert models.param_axes(models.abstract(LCFG)).blocks.gate_proj.weight_IxO == ("layers", "embed", "mlp")
    with pytest.raises(ConfigError, match=r"model.moe.every=2: mixtral \(no QK-norm, no shared expert\) has no dense"):
        hf.hf_dir_config(models.abstract(cfg))
    gpt_moe = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4))
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=4: this family's MoE blocks cannot be exported"):
        hf.hf_dir_config(models.abstract(gpt_moe))
    hf.save_hf(str(tmp_path / "pretrained"), llama.Llama(LCFG, jax.random.PRNGKey(0)))
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=4: a run cannot start its MoE blocks") as e:
        validate(compose_config(*LLAMA, f"model.init_from={tmp_path / 'pretrained'}", "model.moe.num_experts=4"))
    assert "\n" not in str(e.value)


def test_llama_training_steps_lower_the_loss_and_log_the_router():
    """model=llama_tiny at the tiny shape with 4 experts, dropless, every second block MoE: the loss
    falls on a repeated batch and the router's metrics are logged for block 1 alone."""
    _, history = run_steps(*LLAMA, "model.moe.every=2")
    first, last = history[0], history[-1]
    assert last["train/loss"] < first["train/loss"] - 0.1
    assert 1.0 <= first["moe/load_balance_loss"] <= 4.0 and first["moe/router_z_loss"] > 0
    assert first["moe/dropped_fraction"] == 0.0
    assert 0.0 <= first["moe/load/1/min"] <= 0.25 <= first["moe/load/1/max"] <= 1.0
    assert "moe/load/0/min" not in first


# ----------------------------------------------------------------------------- matrix optimizers on experts


def np_newton_schulz(g: np.ndarray, coeffs: np.ndarray, steps: int) -> np.ndarray:
    """optax's Newton–Schulz on one matrix in float64: Frobenius-normalised, the wide orientation,
    X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ."""
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        a = x @ x.T
        x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
    return x.T if tall else x


def test_muon_orthogonalises_each_expert_matrix():
    """An expert-stacked (L, E, D, F) leaf: Muon's first update (momentum 0, lr 1) is -√max(1, F/D) times
    Newton–Schulz of each (D, F) matrix on its own. Orthogonalising over fixed axes (1, 2) would mix
    the E experts into one (E, D) matrix per column: entries off by O(1)."""
    L, E, D, F = 2, 3, 8, 12
    g = jax.random.normal(jax.random.PRNGKey(0), (L, E, D, F), jnp.float32)
    tx = Muon(momentum=0.0, nesterov=False).transform("hidden", lambda _: 1.0)
    state = tx.init({"w": g})
    update = np.asarray(jax.jit(tx.update)({"w": g}, state, {"w": g})[0]["w"])
    coeffs = np.asarray(find_states(state, MuonState)[0].ns_coeffs, np.float64)  # (a, b, c)
    assert coeffs.shape == (3,)
    want = np.stack([[-math.sqrt(F / D) * np_newton_schulz(np.asarray(g[i, e]), coeffs, 5) for e in range(E)]
                     for i in range(L)])
    # float32 against float64 Newton–Schulz (tests/test_groups.py newton_schulz_atol's derivation):
    # an iteration X <- aX + (bA + cA²)X, A = XXᵀ, chains 3 matmuls of inner dimension <= k = max(D, F)
    # = 12 with ‖X‖₂ <= ~1.2; a k-term float32 dot errs by at most ~k·EPS32/2 of |x|·|y| (Higham §3.1),
    # so an iteration adds <= 1.5·k·EPS32 of the result's scale and 5 of them 7.5·k·EPS32; near
    # convergence NS shrinks earlier errors, and the worst-case k per dot (√k typical) leaves a factor
    # √k for their growth through the first iterations (slope <= a = 3.4 at small σ); 2x margin (that
    # bound is for two float32 sides, here one): 3·5·k·EPS32 = 2.1e-5 of the scale, tighter than the
    # 1e-4 it replaces (measured here: ~1e-6).
    np.testing.assert_allclose(update, want, rtol=0, atol=3 * 5 * max(D, F) * EPS32 * np.abs(want).max())


@pytest.mark.parametrize("name", ["shampoo", "soap", "normuon", "dion"])
def test_matrix_optimizers_treat_every_leading_axis_as_a_stack(name):
    """Shampoo and SOAP (optimizer/blocking.py) precondition the last two axes of a hidden leaf: an
    (L, E, D, F) leaf's updates equal those of the same numbers as an (L·E, D, F) stack, exactly.
    NorMuon too: its neuron second moments and its rescaling are per (D, F) matrix; and Dion: its
    buffer, its power iteration and Gram–Schmidt per matrix (its initial Q, one Gaussian draw of the
    stack's shape, is the same numbers in either layout)."""
    g = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8, 12), jnp.float32)
    tx = OPTIMIZERS[name]().transform("hidden", lambda _: 1e-2)

    @jax.jit
    def two_updates(x):
        state, out = tx.init({"w": x}), []
        for i in range(2):
            u, state = tx.update({"w": x * (1 + 0.1 * i)}, state, {"w": x})
            out.append(u["w"])
        return out

    for a, b in zip(two_updates(g), two_updates(g.reshape(6, 8, 12)), strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(6, 8, 12), np.asarray(b))
