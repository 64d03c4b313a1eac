"""`model.attention=auto|xla|cudnn|blocked` (models/attention.py): the choice as a pure function of
backend, dtype, head size and masks (fake machines: this CPU has no GPU), its one-line errors at the
config boundary, the run header's line, and that `xla` and `blocked` are the attention runs had before
the knob (GPT's golden losses, tests/test_golden.py, run with `auto`, which resolves to xla here).
The cuDNN call's plumbing (layouts, the document mask) is checked by standing XLA's kernel in for
cuDNN's, since the real kernel needs a GPU."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config

import models
from models import attention
from models.layers import causal_attention, split_heads
from trainer import header
from utils.config import resolve_vocab, validate
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

# A string condition: evaluated when the test runs, not at collection (JAX's backend starts later).
ON_CPU = pytest.mark.skipif('jax.default_backend() != "cpu"', reason="checks what a CPU run picks and refuses")
GPU_BF16 = dict(backend="gpu", compute_dtype="bfloat16", head_dim=64, context_length=1024, document_mask=False,
                compute_capability="9.0")


def choose(requested="auto", block_size=None, **changes):
    return attention.choose(requested, block_size, **{**GPU_BF16, **changes})


def test_auto_picks_cudnn_only_where_its_requirements_hold():
    assert choose()[0] == "cudnn"
    for changes, why in [
        (dict(backend="cpu"), "needs an NVIDIA GPU (the backend is cpu)"),
        (dict(backend="tpu"), "the backend is tpu"),
        (dict(compute_dtype="float32"), "train.compute_dtype=bfloat16 or float16"),
        (dict(head_dim=60), "multiple of 8"),
        (dict(head_dim=264), "<= 256"),
        (dict(head_dim=192, compute_capability="8.0"), "<= 128"),  # Ampere's limit; Hopper's is 256
    ]:
        impl, reason = choose(**changes)
        assert impl == "xla" and why in reason, (changes, reason)
    assert choose(head_dim=192)[0] == "cudnn" and choose(compute_dtype="float16")[0] == "cudnn"
    # Document masks: correct on cuDNN (a dense bias) but unmeasured, so auto keeps XLA's.
    assert choose(document_mask=True)[0] == "xla"
    # attn_block_size from a config written before the knob keeps block-causal attention, on any machine.
    assert choose(block_size=64)[0] == "blocked" and choose(block_size=64, backend="cpu")[0] == "blocked"


def test_an_explicit_choice_is_kept_or_refused_in_one_line():
    assert choose("xla")[0] == "xla" and choose("blocked", 64)[0] == "blocked"
    assert choose("cudnn", document_mask=True)[0] == "cudnn"  # asked for: the mask as a bias
    for changes in (dict(backend="cpu"), dict(compute_dtype="float32"), dict(head_dim=12),
                    dict(document_mask=True, context_length=1023)):
        with pytest.raises(ConfigError) as e:
            choose("cudnn", **changes)
        message = str(e.value)
        assert message.startswith("model.attention=cudnn: it needs") or "even context" in message
        assert "\n" not in message and "model.attention=auto" in message


def test_knob_errors_at_the_config_boundary(tiny_run):
    assert tiny_run().model.attention == "auto"
    for overrides, match in [
        (("model.attention=flash",), r"model.attention='flash' must be one of auto, xla, cudnn, blocked"),
        (("model.attention=blocked",), r"model.attention=blocked needs model.attn_block_size"),
        (("model.attention=xla", "model.attn_block_size=8"), r"read by model.attention=blocked only"),
        (("model.attention=cudnn",), r"model.attention=cudnn: it needs train.compute_dtype=bfloat16"),
        (("model.attention=cudnn", "train.compute_dtype=bfloat16", "model.dim=36", "model.num_heads=3"),
         r"multiple of 8 and <= 256 \(got 12\)"),
    ]:
        with pytest.raises(ConfigError, match=match):
            tiny_run(*overrides)
    # Both families carry the shared knob.
    with pytest.raises(ConfigError, match="model.attention='flash'"):
        tiny_run("model=llama_tiny", "model.attention=flash")


@ON_CPU
def test_the_backend_decides_once_jax_is_up_and_the_header_says_why(tiny_run, capsys):
    """On this CPU: auto -> xla with its reason; an explicit cudnn that passed validation (bf16,
    head dim 16) is refused in one line before anything compiles; the header prints the choice."""
    run = resolve_vocab(tiny_run(), 60)
    assert run.model.attention == "xla"
    assert run.notes == ("attention: xla (auto: cuDNN flash attention not used because it needs an NVIDIA GPU "
                         f"(the backend is {jax.default_backend()}))",)
    assert resolve_vocab(run, 60).notes == run.notes  # resolved twice (a bench, a script): one line
    assert resolve_vocab(tiny_run("model.attn_block_size=8"), 60).model.attention == "blocked"
    with pytest.raises(ConfigError, match=r"^model.attention=cudnn: it needs an NVIDIA GPU \(the backend is cpu\)"):
        resolve_vocab(tiny_run("model.attention=cudnn", "train.compute_dtype=bfloat16"), 60)

    mesh = meshlib.make_mesh(1, 1, 8, devices=jax.devices()[:1])
    data = types.SimpleNamespace(tokens_per_step=128, fingerprint="f")
    header.announce(run, None, mesh, data, "dir", 1000)
    assert "attention: xla (auto: cuDNN flash attention not used" in capsys.readouterr().out


def _qkv(T=16, H=2, K=8, B=2, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (3, B, H, T, K), jnp.float32)


def _cfg(impl, block=None):
    return types.SimpleNamespace(attention=impl, attn_block_size=block)


U = EPS32 / 2  # float32's unit roundoff: one rounding errs by at most U of its result


def _softmax_tol_terms(q, k, segment_ids_BxT=None, causal=True):
    """(P, ε_p): the probabilities of softmax(q·kᵀ/√K) under the causal and document masks, in
    float64, and the relative error bound of each (per query row, shape B x H x T x 1) in one float32
    attention against exact arithmetic on the same inputs, to first order. With A_t the row's score
    scale, the max over visible s of Σ_k |q_tk·k_sk| / √K: a score is a K-term dot product, (K + 1)·U·A_t
    (helpers.sum_atol's count), then scaled by 1/√K (U·A_t): σ_t = (K + 2)·U·A_t. p_s = exp(s_s − m) /
    Σ_j exp(s_j − m): score errors move p_s by δ_s − Σ_j p_j·δ_j, at most 2σ_t relative; the subtraction
    s − m (|s − m| <= 2A_t) rounds off U·2A_t in the exponent, in p_s and in the denominator's weighted
    mean: 4·U·A_t; exp (~1 ulp, one rounding as in helpers.rounding_rtol) in p_s and in the mean: 2U;
    the sum of T positive terms at most (T − 1)·U; the division U. Masked keys (exp of −1e30: exactly
    0) add nothing."""
    q, k = (np.asarray(a, np.float64) for a in (q, k))
    T, K = q.shape[-2:]
    visible = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
    if segment_ids_BxT is not None:
        seg = np.asarray(segment_ids_BxT)
        visible = visible & (seg[:, None, :, None] == seg[:, None, None, :])
    A = np.where(visible, np.einsum("...tk,...sk->...ts", np.abs(q), np.abs(k)), 0).max(-1, keepdims=True)
    A /= np.sqrt(K)
    scores = np.where(visible, np.einsum("...tk,...sk->...ts", q, k) / np.sqrt(K), -np.inf)
    P = np.exp(scores - scores.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    return P, 2 * (K + 2) * U * A + 4 * U * A + (T + 2) * U


def attention_atol(q, k, v, segment_ids_BxT=None, causal=True, margin=2):
    """atol between two float32 attentions (softmax(q·kᵀ/√K)·v, any summation order, any kernel) on
    the same inputs: each output o_tj = Σ_s p_ts·v_sj is off the exact one by at most
    (ε_p + (T + 1)·U)·Σ_s p_ts·|v_sj| (ε_p of _softmax_tol_terms; the T-term dot product with v:
    helpers.sum_atol's count), so the two differ by at most twice that; the largest over the outputs,
    times `margin`."""
    P, eps_p = _softmax_tol_terms(q, k, segment_ids_BxT, causal)
    T = np.shape(q)[-2]
    scale = P @ np.abs(np.asarray(v, np.float64))
    return float(margin * 2 * ((eps_p + (T + 1) * U) * scale).max())


def attention_grad_tols(q, k, v, r, segment_ids_BxT=None, margin=2):
    """(atol of dq, of dk, of dv) between two float32 backward passes of causal attention with output
    cotangent r (any summation order; the keys' gradients summed over query blocks or not), to first
    order. P and its relative error ε_p from _softmax_tol_terms, D_ts = Σ_j |r_tj·v_sj|, c = 1/√K:
    dP = r·vᵀ (K terms: (K + 1)·U·D_ts); the softmax's transpose dS = P⊙dP − P⊙Σ_s(P⊙dP)_s, with
    |dS_ts| <= 2·P_ts·D_t (D_t = max_s D_ts): P⊙dP errs by P_ts·D_t·(ε_p + (K + 2)·U), the T-term sum
    by D_t·(ε_p + (K + 1)·U + (T + 1)·U), its product with P_ts by P_ts·D_t·(2ε_p + (K + T + 3)·U), the
    subtraction by U·2·P_ts·D_t: η = 3ε_p + (2K + T + 7)·U of P_ts·D_t, and the scaling by c 2U more.
    dq_tj = Σ_s c·dS_ts·k_sj (T terms, each off by c·P_ts·D_t·(η + 2U), their sum by (T + 1)·U of
    Σ_s c·2·P_ts·D_t·|k_sj|): c·(η + (2T + 4)·U)·D_t·Σ_s P_ts·|k_sj|; dk_sj = Σ_t c·dS_ts·q_tj the same
    summed over queries: c·Σ_t (η_t + (2T + 4)·U)·D_t·P_ts·|q_tj|; dv_sj = Σ_t P_ts·r_tj:
    Σ_t (ε_p,t + (T + 1)·U)·P_ts·|r_tj|. Two passes differ by twice each; the largest over the
    entries, times `margin`."""
    P, eps_p = _softmax_tol_terms(q, k, segment_ids_BxT)
    q, k, v, r = (np.abs(np.asarray(a, np.float64)) for a in (q, k, v, r))
    T, K = q.shape[-2:]
    D = np.einsum("...tj,...sj->...ts", r, v).max(-1, keepdims=True)
    w = (3 * eps_p + (2 * K + T + 7) * U + (2 * T + 4) * U) * D * P / np.sqrt(K)  # B x H x T x T, per (t, s)
    dq = w @ k
    dk = np.swapaxes(w, -1, -2) @ q
    dv = np.swapaxes((eps_p + (T + 1) * U) * P, -1, -2) @ r
    return tuple(float(margin * 2 * e.max()) for e in (dq, dk, dv))


def test_xla_and_blocked_are_the_attention_of_before():
    """`xla` is causal_attention in one block and `blocked` the same with query blocks: the very same
    function, so bit for bit; blocked against xla agree to float32 rounding (softmax sums over the same
    keys in another order): within attention_atol, the worst case of two float32 attentions."""
    q, k, v = _qkv()
    seg = jnp.array([[0] * 5 + [1] * 11, [0] * 16])
    for causal, seg_ids in ((True, None), (True, seg), (False, None), (False, seg)):
        ref = causal_attention(q, k, v, segment_ids_BxT=seg_ids, causal=causal)
        np.testing.assert_array_equal(attention.attend(_cfg("xla"), q, k, v, seg_ids, causal), ref)
        np.testing.assert_array_equal(attention.attend(_cfg("auto"), q, k, v, seg_ids, causal), ref)
    for seg_ids in (None, seg):
        blocked = attention.attend(_cfg("blocked", 4), q, k, v, seg_ids)
        np.testing.assert_array_equal(blocked, causal_attention(q, k, v, block_size=4, segment_ids_BxT=seg_ids))
        np.testing.assert_allclose(blocked, causal_attention(q, k, v, segment_ids_BxT=seg_ids),
                                   atol=attention_atol(q, k, v, seg_ids))


def test_the_cudnn_call_passes_layouts_and_masks_right(monkeypatch):
    """jax.nn.dot_product_attention's cuDNN kernel needs a GPU; with XLA's implementation standing in
    (in float32, on the bfloat16 inputs the kernel takes), the cudnn path (B x T x N x H layout,
    is_causal, the document mask) must equal causal_attention on the same inputs, within
    attention_atol: two float32 attentions of the same (bfloat16-exact) values. Float32 inputs
    (sampling's forward) never reach the kernel, which refuses them: they run causal_attention itself."""
    real = jax.nn.dot_product_attention
    calls = []

    def stand_in(*args, implementation=None, **kwargs):
        calls.append(implementation)
        return real(*(a.astype(jnp.float32) for a in args), implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(seed=1))
    seg = jnp.array([[0] * 7 + [1] * 9, [0] * 3 + [1] * 3 + [2] * 10])
    for causal in (True, False):
        for seg_ids in (None, seg):
            got = attention.attend(_cfg("cudnn"), q, k, v, seg_ids, causal)
            want = causal_attention(*(a.astype(jnp.float32) for a in (q, k, v)), segment_ids_BxT=seg_ids,
                                    causal=causal)
            np.testing.assert_allclose(got, want, atol=attention_atol(q, k, v, seg_ids))
    assert calls == ["cudnn"] * 4
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    np.testing.assert_array_equal(attention.attend(_cfg("cudnn"), *f32, seg, True),
                                  causal_attention(*f32, segment_ids_BxT=seg))
    assert calls == ["cudnn"] * 4


@ON_CPU
def test_a_gpu_choice_runs_on_a_cpu_for_inference(tiny_run):
    """A checkpoint trained with cudnn records it; sampling or exporting it on a CPU runs XLA's."""
    cfg = resolve_vocab(tiny_run(), 60).model
    gpu_cfg = attention.resolve(dataclasses.replace(cfg, attention="auto"), "bfloat16", 16, False,
                                backend="gpu", compute_capability="9.0")[0]
    assert gpu_cfg.attention == "cudnn"
    assert attention.portable(gpu_cfg).attention == "xla"
    model = models.build(attention.portable(gpu_cfg), jax.random.PRNGKey(0))
    assert model(jnp.zeros((1, 16), jnp.int32)).shape == (1, 16, 64)


def test_auto_with_a_block_size_keeps_the_numbers_of_before():
    """gpt_bench's attn_block_size under auto resolves to blocked: the same logits as the blocked
    model, bit for bit (the block-causal path configs from before the knob had)."""
    cfg = validate(compose_config("model.attn_block_size=8")).model
    cfg = dataclasses.replace(cfg, vocab_size=64)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
    logits = {impl: models.build(dataclasses.replace(cfg, attention=impl), jax.random.PRNGKey(0))(tokens)
              for impl in ("auto", "blocked")}
    np.testing.assert_array_equal(logits["auto"], logits["blocked"])


def _grads(q, k, v, seed=1, **kwargs):
    """d/d(q, k, v) of <causal_attention(q, k, v, **kwargs), r> for a fixed random r: every output weighs in."""
    r = jax.random.normal(jax.random.PRNGKey(seed), q.shape, jnp.float32)
    return jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, **kwargs) * r), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.slow  # 12 s of the quick set; block-causal attention's forward stays there (test_xla_and_blocked_...)
def test_blocked_gradients_are_the_unblocked_ones():
    """Query blocks cut by split and keys rebuilt by concatenation (models/layers.py) must give the
    gradient of plain causal attention. Both sum the same products over <= 16 keys in another order,
    so they differ by float32 rounding, within attention_grad_tols (the first-order worst case of two
    float32 backward passes: ~1e-4 to 1e-3 here), where a key block read or summed wrongly is order 1."""
    q, k, v = _qkv()
    seg = jnp.array([[0] * 5 + [1] * 11, [0] * 16])
    for seg_ids in (None, seg):
        ref = _grads(q, k, v, segment_ids_BxT=seg_ids)
        for block in (4, 8):
            got = _grads(q, k, v, block_size=block, segment_ids_BxT=seg_ids)
            cotangent = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)  # _grads's r
            for g, r, atol in zip(got, ref, attention_grad_tols(q, k, v, cotangent, seg_ids)):
                # atol per gradient: attention_grad_tols, the float32 worst case of two backward passes
                # (dP, softmax^T, dq/dk/dv sums at the data's scale, 2x margin)
                np.testing.assert_allclose(g, r, rtol=0, atol=atol)


def _primitives(fn, *args) -> set[str]:
    """The primitives of fn's jaxpr, nested jaxprs (pjit, custom_jvp) included."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def test_the_attention_backward_never_pads_to_full_length():
    """The gradients of split_heads and of block-causal attention are concatenations of block-sized
    pieces: no `pad` (the transpose of indexing or slicing, which on XLA:CPU wrote a zero-filled
    full-size copy of dq/dk/dv per head part and per query block: ~8% of a gpt_bench step)."""
    B, T, H, K = 2, 16, 2, 8
    qkv = jax.random.normal(jax.random.PRNGKey(0), (B, T, 3 * H * K), jnp.float32)
    loss = lambda qkv: jnp.sum(causal_attention(*split_heads(qkv, H, K), block_size=4) ** 2)
    assert "pad" not in _primitives(jax.grad(loss), qkv)
    slicing = lambda qkv: jnp.sum(qkv.reshape(B, T, H, 3, K)[:, :, :, 0] ** 2)  # what the check catches
    assert "pad" in _primitives(jax.grad(slicing), qkv)


def test_split_heads_reads_the_head_major_columns():
    """The fused projection's columns are (head, q|k|v, K) (models/gpt.py `_head_major`): head h's
    query is columns [h·3K, h·3K + K), its key the next K, its value the K after; and the gradient
    puts each head's cotangent back in those columns (a permutation: exact)."""
    B, T, H, K = 2, 3, 2, 4
    qkv = jnp.arange(B * T * 3 * H * K, dtype=jnp.float32).reshape(B, T, 3 * H * K)
    q, k, v = split_heads(qkv, H, K)
    for part, x_BxHxTxK in enumerate((q, k, v)):
        for h in range(H):
            start = h * 3 * K + part * K
            np.testing.assert_array_equal(x_BxHxTxK[:, h], qkv[:, :, start : start + K])
    _, pullback = jax.vjp(lambda a: split_heads(a, H, K), qkv)
    np.testing.assert_array_equal(pullback([q, k, v])[0], qkv)
