"""models/gpt.py: causality, initial loss, remat equivalence, parameter groups, attention against a
NumPy reference, the FLOP count, dropout. Tiny models only. (Scan = unrolled, sharded = one device,
resume and the HF round trip run for every family in tests/test_model_contract.py.)

Compilation dominates on a small CPU, so every model is built once per config (`build`) and
its variants that differ only in execution flags (scan, remat, dropout) reuse its weights
(`with_cfg`); forward and gradient functions are jitted and shared across tests.
"""

import dataclasses
import functools
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32

from models.gpt import GPT, GPTConfig, flops_per_token, param_labels
from models.layers import REMAT_POLICIES, causal_attention
from models.losses import cross_entropy

CFG = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64)
DROPOUT_CFG = dataclasses.replace(CFG, dropout=0.5)
T = CFG.context_length
NO_REMAT, REMATS = "none", [name for name in REMAT_POLICIES if name != "none"]  # model.remat's policies
# Tolerances from float32 rounding (EPS32 = 2⁻²³ ≈ 1.19e-7), at the scale of the values compared: the
# tiny model's dot products have <= 128 terms (the MLP's down projection), each rounding to ~√128·EPS32
# ≈ 11 EPS32 of its terms' scale; backward, the gradients sum that over the batch's 64 tokens too.
ROUNDING = math.sqrt(128) * EPS32
GRAD_ROUNDING = (math.sqrt(64) + math.sqrt(128)) * EPS32


def scale(x) -> float:
    """The largest magnitude in x: the scale a float32 sum's rounding is relative to."""
    return float(np.abs(np.asarray(x)).max())


@functools.lru_cache(maxsize=None)
def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    return eqx.filter_jit(GPT)(cfg, jax.random.PRNGKey(seed))


def with_cfg(model: GPT, cfg: GPTConfig) -> GPT:
    """`model`'s weights under another (static) config: flags that change execution, not shapes.
    (eqx.tree_at cannot replace a static field, so rebuild the tree from a shape-only model.)"""
    treedef = jax.tree.structure(eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0)))
    return jax.tree.unflatten(treedef, jax.tree.leaves(model))


forward = eqx.filter_jit(lambda model, tokens_BxT, key=None: model(tokens_BxT, key=key))
loss_and_grads = eqx.filter_jit(eqx.filter_value_and_grad(cross_entropy, has_aux=True))


def _tokens(shape, vocab=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


def _path_name(path) -> str:
    return ".".join(p.name for p in path)


def _leaves_by_name(tree) -> dict:
    return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _numpy_nll(logits_NxV: np.ndarray, targets_N: np.ndarray) -> float:
    x = logits_NxV.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp_NxV = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-logp_NxV[np.arange(len(targets_N)), targets_N].mean())


# --- causality and initialisation ---------------------------------------------------------------


def test_changing_a_token_changes_only_its_own_and_later_logits():
    model = build(CFG)
    t = 6
    tokens_BxT = _tokens((2, T))
    changed_BxT = tokens_BxT.copy()
    changed_BxT[:, t + 1] = (changed_BxT[:, t + 1] + 17) % CFG.vocab_size
    logits_BxTxV = np.asarray(forward(model, jnp.asarray(tokens_BxT)))
    changed_logits_BxTxV = np.asarray(forward(model, jnp.asarray(changed_BxT)))

    # Equal in exact arithmetic and in float32 too (a masked probability is exactly 0, and adds
    # exactly 0): at most the forward's sums ordered differently, one ROUNDING.
    np.testing.assert_allclose(changed_logits_BxTxV[:, : t + 1], logits_BxTxV[:, : t + 1], rtol=0,
                               atol=ROUNDING * scale(logits_BxTxV))
    diff_BxT = np.abs(changed_logits_BxTxV - logits_BxTxV).max(-1)
    assert (diff_BxT[:, t + 1 :] > 1e-5).all(), diff_BxT  # every later position sees the change


def test_fresh_model_loss_is_close_to_log_vocab():
    tokens_BxT1 = _tokens((8, T + 1), seed=1)
    logits_BxTxV = np.asarray(forward(build(CFG), jnp.asarray(tokens_BxT1[:, :-1])))
    loss = _numpy_nll(logits_BxTxV.reshape(-1, CFG.vocab_size), tokens_BxT1[:, 1:].reshape(-1))
    assert abs(loss - math.log(CFG.vocab_size)) < 0.1


def test_gpt2_init_scales():
    """Embeddings and block matrices N(0, 0.02), residual projections 0.02/sqrt(2L) (here 0.01),
    zero biases, unit gains. Loose statistical bounds: each array holds >= 512 values."""
    leaves = _leaves_by_name(build(CFG))
    resid = 0.02 / math.sqrt(2 * CFG.num_blocks)
    for name, std in [("wte_VxD", 0.02), ("wpe_TxD", 0.02), ("blocks.attn_qkv.weight_IxO", 0.02),
                      ("blocks.mlp_in.weight_IxO", 0.02), ("blocks.attn_out.weight_IxO", resid),
                      ("blocks.mlp_out.weight_IxO", resid)]:
        assert abs(float(jnp.std(leaves[name])) / std - 1) < 0.15, name
    for name, leaf in leaves.items():
        if "bias" in name:
            assert not np.any(np.asarray(leaf)), name
        if "gain" in name:
            assert np.all(np.asarray(leaf) == 1.0), name
    assert leaves["blocks.attn_qkv.weight_IxO"].shape == (CFG.num_blocks, CFG.dim, 3 * CFG.dim)
    # The blocks are initialised independently (not one block copied L times).
    w = np.asarray(leaves["blocks.attn_qkv.weight_IxO"])
    assert not np.allclose(w[0], w[1])


# --- equivalent execution paths ------------------------------------------------------------------


def test_with_cfg_keeps_weights_and_swaps_flags():
    model = build(CFG)
    unrolled = with_cfg(model, dataclasses.replace(CFG, scan_blocks=False))
    assert not unrolled.cfg.scan_blocks and model.cfg.scan_blocks
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(unrolled), strict=True):
        assert a is b


def test_remat_gives_the_same_loss_and_gradients():
    tokens_BxT1 = jnp.asarray(_tokens((4, T + 1)))
    model = with_cfg(build(CFG), dataclasses.replace(CFG, remat=NO_REMAT))
    (loss, _), grads = loss_and_grads(model, tokens_BxT1, None, jnp.float32)
    flat = _leaves_by_name(grads)
    assert len(flat) == 16 and any(float(jnp.abs(g).max()) > 1e-4 for g in flat.values())  # not all zero
    for flags in [{"remat": r} for r in REMATS]:
        variant = with_cfg(model, dataclasses.replace(CFG, **flags))
        (loss_v, _), grads_v = loss_and_grads(variant, tokens_BxT1, None, jnp.float32)
        # The same forward: the loss, a mean over 64 tokens of 64-way log-softmaxes, at most summed in
        # another order (√64·EPS32 relative).
        np.testing.assert_allclose(loss_v, loss, rtol=math.sqrt(64) * EPS32)
        flat_v = _leaves_by_name(grads_v)
        assert flat_v.keys() == flat.keys()
        for name in flat:  # recomputed activations, re-fused: GRAD_ROUNDING of each leaf's scale, 4x
            np.testing.assert_allclose(flat_v[name], flat[name], rtol=0, atol=4 * GRAD_ROUNDING * scale(flat[name]),
                                       err_msg=f"{flags} {name}")


def test_cross_entropy_matches_numpy():
    model = build(CFG)
    tokens_BxT1 = _tokens((4, T + 1), seed=9)
    (loss, correct), _ = loss_and_grads(model, jnp.asarray(tokens_BxT1), None, jnp.float32)
    logits_BxTxV = np.asarray(forward(model, jnp.asarray(tokens_BxT1[:, :-1])))
    targets_BxT = tokens_BxT1[:, 1:]
    nll = _numpy_nll(logits_BxTxV.reshape(-1, CFG.vocab_size), targets_BxT.reshape(-1))
    # float32 against float64 on the same logits: a log-softmax over 64 and a mean over 64 tokens, two
    # 64-term sums, ≲ √64·EPS32 relative each; 4x.
    np.testing.assert_allclose(float(loss), nll, rtol=4 * 2 * math.sqrt(64) * EPS32)
    assert int(correct) == int((logits_BxTxV.argmax(-1) == targets_BxT).sum())


# --- parameter groups --------------------------------------------------------------------------

BLOCK_LABELS = {
    "blocks.ln1.gain_D": "scalar", "blocks.ln1.bias_D": "scalar",
    "blocks.attn_qkv.weight_IxO": "hidden", "blocks.attn_qkv.bias_O": "scalar",
    "blocks.attn_out.weight_IxO": "hidden", "blocks.attn_out.bias_O": "scalar",
    "blocks.ln2.gain_D": "scalar", "blocks.ln2.bias_D": "scalar",
    "blocks.mlp_in.weight_IxO": "hidden", "blocks.mlp_in.bias_O": "scalar",
    "blocks.mlp_out.weight_IxO": "hidden", "blocks.mlp_out.bias_O": "scalar",
    "ln_f.gain_D": "scalar", "ln_f.bias_D": "scalar",
    "wte_VxD": "embed", "wpe_TxD": "embed",
}


@pytest.mark.parametrize("tied", [True, False])
def test_param_labels_name_every_group(tied):
    # Shape-only models (how train_jax builds the labels): no compilation needed.
    model = eqx.filter_eval_shape(GPT, dataclasses.replace(CFG, tie_embeddings=tied), jax.random.PRNGKey(0))
    labels = param_labels(model)
    expected = dict(BLOCK_LABELS) if tied else {**BLOCK_LABELS, "head_DxV": "head"}
    assert _leaves_by_name(labels) == expected
    assert (model.head_DxV is None) == tied
    # The label tree mirrors the parameter tree, so optax can use it as a mask/label pytree.
    assert jax.tree.structure(labels) == jax.tree.structure(model)


def test_param_labels_without_biases():
    model = eqx.filter_eval_shape(GPT, dataclasses.replace(CFG, bias=False), jax.random.PRNGKey(0))
    expected = {k: v for k, v in BLOCK_LABELS.items() if "bias" not in k}
    assert _leaves_by_name(param_labels(model)) == expected


# --- attention, FLOPs, dropout -----------------------------------------------------------------


def _numpy_causal_attention(q, k, v):
    B, H, T, K = q.shape
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                s = np.array([q[b, h, t] @ k[b, h, j] for j in range(t + 1)], np.float64) / np.sqrt(K)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, h, t] = sum(p[j] * v[b, h, j] for j in range(t + 1))
    return out


# q·k over K = 4, the softmax's and the weighted sum's <= 8 terms: three float32 sums, ≲ √8·EPS32 each of
# v's scale (a sum's rounding is relative to its terms, not to its result); 4x.
ATTENTION_ROUNDING = 4 * 3 * math.sqrt(8) * EPS32


def test_causal_attention_matches_numpy_reference():
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(2, 3, 8, 4)).astype(np.float32) for _ in range(3))
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    np.testing.assert_allclose(got, _numpy_causal_attention(q, k, v), rtol=0, atol=ATTENTION_ROUNDING * scale(v))
    # The first position sees only itself: exp(0) normalised by itself, v to a rounding or two.
    np.testing.assert_allclose(got[:, :, 0], v[:, :, 0], rtol=2 * EPS32)


@pytest.mark.skipif("block_size" not in inspect.signature(causal_attention).parameters,
                    reason="causal_attention has no block_size")
@pytest.mark.parametrize("block_size", [2, 4, 3])  # 3 does not divide T=8: falls back to one block
def test_block_causal_attention_matches_numpy_reference(block_size):
    rng = np.random.default_rng(8)
    q, k, v = (rng.normal(size=(2, 3, 8, 4)).astype(np.float32) for _ in range(3))
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block_size=block_size))
    np.testing.assert_allclose(got, _numpy_causal_attention(q, k, v), rtol=0, atol=ATTENTION_ROUNDING * scale(v))


def test_flops_per_token_hand_count():
    # dim 32, 2 blocks, mlp 4x, vocab 64, seq 16. Per block: qkv 32*96 + out 32*32 + mlp 2*32*128
    # = 3072 + 1024 + 8192 = 12288 matmul weights; x2 blocks = 24576; head (tied: wte^T) 32*64 = 2048;
    # N = 26624 -> 6N = 159744. Attention: 12 * 2 blocks * 32 dim * 16 seq = 12288. Total 172032.
    assert flops_per_token(CFG, 16) == 172032
    # The head does the same work tied or untied.
    untied = dataclasses.replace(CFG, tie_embeddings=False)
    assert flops_per_token(untied, 16) == 172032
    # Cross-check against the matrices of a (shape-only, untied) model: block matrices + head.
    leaves = _leaves_by_name(eqx.filter_eval_shape(GPT, untied, jax.random.PRNGKey(0)))
    n_matmul = sum(x.size for name, x in leaves.items() if name.endswith("weight_IxO") or name == "head_DxV")
    assert flops_per_token(CFG, 16) == 6 * n_matmul + 12 * CFG.num_blocks * CFG.dim * 16


def test_dropout_needs_a_key_and_changes_outputs():
    no_dropout = build(CFG)
    model = with_cfg(no_dropout, DROPOUT_CFG)
    tokens_BxT = jnp.asarray(_tokens((2, T)))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)

    evaluation = np.asarray(forward(model, tokens_BxT))
    same = ROUNDING * scale(evaluation)  # no mask applied: the same ops, at most summed in another order
    np.testing.assert_array_equal(forward(model, tokens_BxT), evaluation)  # key=None: deterministic ...
    np.testing.assert_allclose(forward(no_dropout, tokens_BxT), evaluation, rtol=0, atol=same)  # ... no dropout
    dropped_1 = np.asarray(forward(model, tokens_BxT, k1))
    np.testing.assert_array_equal(forward(model, tokens_BxT, k1), dropped_1)  # same key, same mask
    # "differs": another mask moves logits by O(scale), rounding by ~ROUNDING·scale (1e-6): 1e-4 sits between
    assert not np.allclose(dropped_1, evaluation, atol=1e-4)
    assert not np.allclose(dropped_1, forward(model, tokens_BxT, k2), atol=1e-4)  # the same
    # dropout=0 ignores the key altogether.
    np.testing.assert_allclose(forward(no_dropout, tokens_BxT, k1), evaluation, rtol=0, atol=same)


# --- bfloat16 compute ----------------------------------------------------------------------------


def _equations(jaxpr):
    """Every equation of a jaxpr, nested ones (scan bodies, remat, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bfloat16_compute_keeps_the_residual_stream_and_logits_float32():
    """Under compute_dtype=bfloat16 the matmuls take bfloat16 inputs, but the head accumulates in
    float32 (no bfloat16 logits) and the residual stream, the scan's carry, stays float32 (in
    bfloat16 a block's small update to it would round away)."""
    jaxpr = jax.make_jaxpr(lambda m, t: m(t, compute_dtype=jnp.bfloat16))(build(CFG), _tokens((2, T))).jaxpr
    eqns = list(_equations(jaxpr))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    head = [e for e in dots if e.outvars[0].aval.shape == (2, T, CFG.vocab_size)]
    assert len(head) == 1 and str(head[0].invars[0].aval.dtype) == "bfloat16"  # really bf16 compute
    assert str(head[0].outvars[0].aval.dtype) == "float32"
    carry = next(e for e in eqns if e.primitive.name == "scan").outvars[0].aval
    assert carry.shape == (2, T, CFG.dim) and str(carry.dtype) == "float32"


def test_bfloat16_heads_backward_matmuls_take_bfloat16_operands():
    """The head's float32 logits must not make its backward float32: JAX's own transpose of the
    float32-accumulating matmul promotes the gradient's two matmuls to float32 (TF32 on a GPU, 7.6 of
    GPT-2 124M's 58 ms H100 step). models/layers.output_logits rounds the logits' gradient first."""
    model, tokens = build(CFG), _tokens((2, T + 1))

    def loss(m):
        logits = m(tokens[:, :-1], compute_dtype=jnp.bfloat16)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()

    eqns = list(_equations(jax.make_jaxpr(eqx.filter_grad(loss))(model).jaxpr))
    head = [e for e in eqns if e.primitive.name == "dot_general"
            and any(CFG.vocab_size in v.aval.shape for v in e.invars)]
    assert len(head) == 3  # the logits, then the gradients of the head's input and of its weights
    assert all(str(v.aval.dtype) == "bfloat16" for e in head for v in e.invars), \
        [[str(v.aval.dtype) for v in e.invars] for e in head]


def test_bfloat16_heads_gradients_match_float64():
    """output_logits' backward against float64 on the same bfloat16-rounded inputs and gradient:
    each result is a float32 sum of n = V (input gradient) or B·T (weight gradient) products of
    bfloat16 values (exact in float32), then rounded once to bfloat16: 2⁻⁸ relative (half an ulp of its
    8-bit significand, times a margin of 2) plus the float32 sum's bound (helpers.sum_atol)."""
    from helpers import sum_atol

    from models.layers import output_logits

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (2, 8, 32)), jax.random.normal(kw, (32, 48))
    g = jax.random.normal(kg, (2, 8, 48))
    logits, pullback = jax.vjp(lambda x, w: output_logits(x, w, jnp.bfloat16), x, w)
    dx, dw = pullback(g)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)
    xb, wb, gb = as64(x), as64(w), as64(g)
    np.testing.assert_allclose(np.asarray(logits), xb @ wb, rtol=0, atol=sum_atol(32, scale(np.abs(xb) @ np.abs(wb))))
    dw_ref, dw_abs = (np.einsum("btd,btv->dv", a, b) for a, b in ((xb, gb), (np.abs(xb), np.abs(gb))))
    for ours, ref, ref_abs, n in ((dx, gb @ wb.T, np.abs(gb) @ np.abs(wb).T, 48), (dw, dw_ref, dw_abs, 16)):
        # rtol: one rounding to bfloat16 (8-bit significand: 2⁻⁹ relative), margin 2; atol: the float32 sum
        np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=2.0**-8, atol=sum_atol(n, scale(ref_abs)))


# --- sampling ------------------------------------------------------------------------------------


def test_sampling_stays_inside_the_trained_window():
    """A model trained on dataset.context_length=8 of its 16 positions samples exactly as the same
    weights cut to 8 positions: the untrained position embeddings 8..15 are never used."""
    from models.sample import generate

    model = build(CFG)
    short_cfg = dataclasses.replace(CFG, context_length=8)
    short = eqx.tree_at(lambda m: m.wpe_TxD, with_cfg(model, CFG), model.wpe_TxD[:8])
    short = jax.tree.unflatten(jax.tree.structure(eqx.filter_eval_shape(GPT, short_cfg, jax.random.PRNGKey(0))),
                               jax.tree.leaves(short))
    key = jax.random.PRNGKey(3)
    want = generate(short, [1, 2, 3], 20, key, temperature=1.0)
    got = generate(model, [1, 2, 3], 20, key, temperature=1.0, context_length=8)
    assert len(got) == 23  # the window slid 15 times
    np.testing.assert_array_equal(got, want)


class _Traces:
    """Shapes a forward pass was traced with (hashable by identity: a static field of a jitted module)."""

    def __init__(self):
        self.shapes: list = []


class _CountingModel(eqx.Module):
    """A model whose forward pass records each trace of it (Python runs only while jax traces)."""
    inner: GPT
    traces: _Traces = eqx.field(static=True)

    @property
    def cfg(self):
        return self.inner.cfg

    def __call__(self, x, **kwargs):
        self.traces.shapes.append(x.shape)
        return self.inner(x, **kwargs)


def test_generation_compiles_one_program():
    """A whole sample is one compiled program, with the model placed on a mesh as a run's is: a key
    split eagerly, or handed back on the mesh, compiled more programs at every run's start (seconds
    on a small CPU, competing with the step's compilation). Sampling the same model again compiles nothing."""
    from models.sample import generate

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    model = jax.device_put(build(CFG), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    counting = _CountingModel(model, _Traces())
    first = generate(counting, [1, 2, 3], 6, jax.random.PRNGKey(5), temperature=1.0)
    again = generate(counting, [4], 3, jax.random.PRNGKey(6), temperature=1.0)
    assert counting.traces.shapes == [(1, T)], counting.traces.shapes
    assert len(first) == 9 and len(again) == 4
    np.testing.assert_array_equal(first, generate(model, [1, 2, 3], 6, jax.random.PRNGKey(5), temperature=1.0))


def test_printable_escapes_control_bytes_but_keeps_text():
    from models.sample import printable

    assert printable("def f():\n\treturn 'é'") == "def f():\n\treturn 'é'"
    assert printable("a\x1b[2Jb\x07\x00") == "a\\x1b[2Jb\\x07\\x00"
