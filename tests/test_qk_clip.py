"""optimizer.qk_clip_tau (QK-clip, Kimi K2's MuonClip; trainer/qk_clip.py): the per-head max logits the
model reports against a float64 NumPy recomputation of the attention logits (both families, GQA,
scan and unrolled blocks, xla and blocked attention, causal and bidirectional, packed documents,
grouped MoE blocks); the rescale against pytorch_optimizer 4.1.0's MuonClip; the train step's clip
(clipped heads end at or under τ at the weights it leaves, every other weight bit-identical to the
plain update); the knob off leaves the loss the plain one; its refusals."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config

import models
from models import attention, llama
from models.layers import document_positions
from trainer import qk_clip
from utils.config import resolve_vocab, validate
from utils.errors import ConfigError

U = EPS32 / 2  # float32's unit roundoff
B, T, V = 2, 8, 64


def tiny(family: str = "gpt", *overrides: str):
    """A tiny model config (vocab resolved): gpt dim 32, 2 heads; llama dim 32, 4 query heads over 2 kv heads."""
    base = ("model=llama_tiny", "model.dim=32", "model.num_blocks=2", "model.num_heads=4", "model.num_kv_heads=2",
            "model.context_length=16") if family == "llama" else ()
    run = validate(compose_config(*base, *overrides))
    return dataclasses.replace(run.model, vocab_size=V)


def tokens_and_segments(seed: int = 0):
    rng = np.random.default_rng(seed)
    seg_BxT = np.repeat(np.array([[0, 0, 0, 1, 1, 1, 1, 2]]), B, axis=0).astype(np.int32)
    return jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32), jnp.asarray(seg_BxT)


def block_list(blocks) -> list:
    """The stacked blocks one by one, in model order (grouped MoE: each group's dense ones, then its MoE one)."""
    if isinstance(blocks, models.moe.Group):
        G, every = jax.tree.leaves(blocks.dense)[0].shape[:2]
        return [b for g in range(G) for b in
                [jax.tree.map(lambda a, g=g, j=j: a[g, j], blocks.dense) for j in range(every)]
                + [jax.tree.map(lambda a, g=g: a[g], blocks.moe)]]
    L = jax.tree.leaves(blocks)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(L)]


def reference_max_logits(model, tokens_BxT, seg_BxT=None, causal=True, stream=None):
    """(float64 max visible logit per block and query head (L, H), its float32 atol per (L, H)).

    Each block's input is the model's own float32 stream (its blocks called one by one, in JAX; with
    `stream`, that model's: a clipped model's logits on the inputs its blocks had before the clip);
    the logits from it are recomputed in float64 NumPy: the norm, the q and k projections (rotary
    for llama, kv head h // group for query head h), q·k·scale, the causal / document mask.

    atol: the float32 logit is scale·Σ_k q_k·k_k over K terms (K + 1 roundings of Σ|q_k·k_k|),
    with q and k each a D-term dot product of the normed input (D + 1 roundings of Σ_d|h_d·W_dk|,
    and the norm's own ~D + 5: its mean and variance sums, rsqrt, gain) plus, for llama, rotary's
    angle t·f (t <= T, so |angle error| <= T·u) and its 2-term rotation (4 roundings): per element
    |δq| <= (2D + 6 + T + 4)·u·Q̄ with Q̄ the abs-sum bound of q (rotated pairs added), k alike.
    So |δlogit| <= scale·u·(K + 1 + 2·(2D + 10 + T))·Σ_k Q̄_k·K̄_k; margin 2 (sum_atol's, helpers.py)."""
    cfg = model.cfg
    B, T = tokens_BxT.shape
    H, K = cfg.num_heads, cfg.head_dim
    G = getattr(cfg, "kv_heads", H)
    scale = attention.mup.attention_scale(cfg)
    scale = 1.0 / np.sqrt(K) if scale is None else scale
    is_llama = cfg.name == "llama"
    if is_llama:
        x = jnp.take(model.embed_VxD, tokens_BxT, axis=0)
        pos_BxT = np.broadcast_to(np.arange(T), (B, T)) if seg_BxT is None else np.asarray(document_positions(seg_BxT))
        rope = (K, cfg.rope_theta, cfg.rope_scaling, cfg.context_length)
        if seg_BxT is None:
            cos_sin = llama.rotary_cos_sin(jnp.arange(T), *rope)
        else:
            cos, sin = llama.rotary_cos_sin(document_positions(seg_BxT), *rope)
            cos_sin = (cos[:, None], sin[:, None])
    else:
        wpe = model.wpe_TxD[:T] if seg_BxT is None else jnp.take(model.wpe_TxD, document_positions(seg_BxT), axis=0)
        x = jnp.take(model.wte_VxD, tokens_BxT, axis=0) + wpe
    visible_BxTxS = np.ones((B, T, T), bool)
    if causal:
        visible_BxTxS &= np.tril(np.ones((T, T), bool))[None]
    if seg_BxT is not None:
        seg = np.asarray(seg_BxT)
        visible_BxTxS &= seg[:, :, None] == seg[:, None, :]
    D = cfg.dim
    per_elem = 2 * D + 10 + (T if is_llama else 0)
    maxes, atols = [], []
    for block, carrier in zip(block_list(model.blocks), block_list((stream or model).blocks), strict=True):
        x64 = np.asarray(x, np.float64)
        if is_llama:
            g = np.asarray(block.attn_norm.gain_D, np.float64)
            h = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + block.attn_norm.eps) * g
        else:
            mean = x64.mean(-1, keepdims=True)
            h = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
            h = h * np.asarray(block.ln1.gain_D, np.float64) + np.asarray(block.ln1.bias_D, np.float64)

        def proj(lin, heads, h=h):
            w = np.asarray(lin.weight_IxO, np.float64)
            b = 0.0 if lin.bias_O is None else np.asarray(lin.bias_O, np.float64)
            y, bound = h @ w + b, np.abs(h) @ np.abs(w) + np.abs(b)
            return (a.reshape(B, T, heads, -1).transpose(0, 2, 1, 3) for a in (y, bound))

        if is_llama:
            (q, qb), (k, kb) = proj(block.q_proj, H), proj(block.k_proj, G)
            inv = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2) / K)
            ang = pos_BxT[:, None, :, None] * np.concatenate([inv, inv])[None, None, None]
            rot = lambda a: np.concatenate([-a[..., K // 2:], a[..., : K // 2]], -1)
            q, k = q * np.cos(ang) + rot(q) * np.sin(ang), k * np.cos(ang) + rot(k) * np.sin(ang)
            qb, kb = qb + np.abs(rot(qb)), kb + np.abs(rot(kb))
            k, kb = (np.repeat(a, H // G, axis=1) for a in (k, kb))
        else:
            w = np.asarray(block.attn_qkv.weight_IxO, np.float64).reshape(D, H, 3, K)
            b = np.asarray(block.attn_qkv.bias_O, np.float64).reshape(H, 3, K)
            q, k = (np.einsum("btd,dhk->bhtk", h, w[:, :, i]) + b[None, :, i, None] for i in (0, 1))
            qb, kb = (np.einsum("btd,dhk->bhtk", np.abs(h), np.abs(w[:, :, i])) + np.abs(b[None, :, i, None])
                      for i in (0, 1))
        logits = np.einsum("bhtk,bhsk->bhts", q, k) * scale
        bound = np.einsum("bhtk,bhsk->bhts", qb, kb) * scale
        vis = visible_BxTxS[:, None]
        maxes.append(np.where(vis, logits, -np.inf).max(axis=(0, 2, 3)))
        atols.append(2 * U * (K + 1 + 2 * per_elem) * np.where(vis, bound, 0).max(axis=(0, 2, 3)))
        out = run_block(carrier, cfg, x, cos_sin if is_llama else None, seg_BxT, causal, is_llama)
        x = out[0] if isinstance(out, tuple) else out
    return np.stack(maxes), np.stack(atols)


@eqx.filter_jit
def run_block(block, cfg, x, cos_sin, seg_BxT, causal, is_llama):
    """One of the model's own blocks, jitted (op by op, a block dispatches hundreds of small kernels)."""
    if is_llama:
        return block(x, None, cfg, jnp.float32, cos_sin, seg_BxT, causal)
    return block(x, None, cfg, jnp.float32, seg_BxT, causal)


@eqx.filter_jit
def forward(model, tokens_BxT, seg_BxT=None, causal=True):
    """The model's logits and reported statistics (max_logits=True), jitted."""
    return model(tokens_BxT, segment_ids_BxT=seg_BxT, causal=causal, max_logits=True)


def perturbed_model(cfg, seed=0, scale=0.3):
    """A model whose attention logits are far from 0 (init's are ~1e-3): every weight moved by scale·N(0,1)."""
    model = models.build(cfg, jax.random.PRNGKey(seed))
    arrays, rest = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(seed)
    moved = jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + scale * rng.standard_normal(a.shape), a.dtype), arrays)
    return eqx.combine(moved, rest)


SLOW = pytest.mark.slow  # ~4-10 s each on the 2-core VM (a forward and each block compiled): the quick set keeps two
CASES = [  # (family, overrides, causal, packed documents)
    pytest.param("gpt", ("model.attention=xla",), True, False, id="gpt-scan-xla"),
    pytest.param("gpt", ("model.scan_blocks=false", "model.attention=blocked", "model.attn_block_size=4"), True,
                 True, id="gpt-unrolled-blocked-docs", marks=SLOW),
    pytest.param("gpt", ("model.moe.num_experts=2", "model.moe.every=2"), False, True,
                 id="gpt-bidirectional-grouped-moe", marks=SLOW),
    pytest.param("llama", ("model.attention=blocked", "model.attn_block_size=4"), True, False,
                 id="llama-gqa-scan-blocked", marks=SLOW),
    pytest.param("llama", ("model.scan_blocks=false", "model.moe.num_experts=2"), True, True,
                 id="llama-gqa-unrolled-docs-moe", marks=SLOW),
    pytest.param("llama", ("model.qkv_bias=true",), False, False, id="llama-gqa-qkv-bias-bidirectional"),
]


@pytest.mark.parametrize("family,overrides,causal,docs", CASES)
def test_the_reported_max_logits_are_the_attention_logits_max(family, overrides, causal, docs):
    cfg = tiny(family, *overrides)
    model = perturbed_model(cfg)
    tokens, seg = tokens_and_segments()
    seg = seg if docs else None
    logits, stats = forward(model, tokens, seg, causal)
    assert stats["max_logit"].shape == (cfg.num_blocks, cfg.num_heads) and stats["max_logit"].dtype == jnp.float32
    want, atol = reference_max_logits(model, tokens, seg, causal)
    assert np.abs(want).max() > 1.0  # logits far from 0: the check is not vacuous
    np.testing.assert_array_less(np.abs(np.asarray(stats["max_logit"], np.float64) - want), atol)
    # and the logits are the model's without the flag (the same function)
    np.testing.assert_array_equal(logits, model(tokens, segment_ids_BxT=seg, causal=causal))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_loss_aux_carries_the_max_logits_only_when_asked(family):
    """models.train_loss(max_logits=True): aux["max_logit"] (L, H), the same loss; off, the plain loss's aux."""
    cfg = tiny(family)
    model = perturbed_model(cfg)
    batch = jnp.concatenate([tokens_and_segments()[0], tokens_and_segments(1)[0][:, :1]], axis=1)
    objective = validate(compose_config()).objective
    plain = models.train_loss(cfg, objective)
    assert plain is objective.loss_fn  # off: the very function runs had before the knob
    loss0, aux0 = plain(model, batch, None, jnp.float32)
    loss1, aux1 = models.train_loss(cfg, objective, max_logits=True)(model, batch, None, jnp.float32)
    assert "max_logit" not in aux0 and aux1["max_logit"].shape == (cfg.num_blocks, cfg.num_heads)
    assert float(loss0) == float(loss1)
    want, atol = reference_max_logits(model, batch[:, :-1])
    np.testing.assert_array_less(np.abs(np.asarray(aux1["max_logit"], np.float64) - want), atol)


# --- the rescale --------------------------------------------------------------------------------


@pytest.mark.parametrize("family,overrides", [
    pytest.param("gpt", (), id="gpt"), pytest.param("llama", ("model.qkv_bias=true",), id="llama-gqa-qkv-bias"),
    pytest.param("gpt", ("model.moe.num_experts=2", "model.moe.every=2"), id="gpt-grouped-moe", marks=SLOW)])
def test_after_the_clip_every_head_is_at_or_under_tau_and_the_rest_keeps_its_bits(family, overrides):
    """clip(model, its own max logits, τ): on the inputs each block had (a clip in block 0 changes
    block 1's input: no rule can promise the next forward's deeper maxima), a clipped head's max
    logit at the new weights is τ (MHA) or at most τ (GQA: sqrt(γ_h·γ_g) <= γ_h), an unclipped head's
    its own (MHA) or at most it; every array but the q/k projections of clipped heads (kv groups)
    unchanged to the bit. The model's reported max at the new weights is the reference's there too."""
    cfg = tiny(family, *overrides)
    model = perturbed_model(cfg)
    tokens, _ = tokens_and_segments()
    before = np.asarray(forward(model, tokens)[1]["max_logit"], np.float64)
    tau = float(np.median(before))  # about half the heads clip
    clipped = before > tau
    assert 0 < clipped.sum() < clipped.size
    new, metrics = qk_clip.clip(model, jnp.asarray(before, jnp.float32), tau)
    assert int(metrics["optim/qk_clip/clipped_heads"]) == clipped.sum()
    assert float(metrics["optim/qk_clip/max_logit"]) == np.float32(before.max())
    now, now_atol = reference_max_logits(new, tokens)
    reported = np.asarray(forward(new, tokens)[1]["max_logit"], np.float64)
    np.testing.assert_array_less(np.abs(reported - now), now_atol)
    np.testing.assert_array_less(now[0][clipped[0]], tau + now_atol[0][clipped[0]])  # block 0: the same input
    after, atol = reference_max_logits(new, tokens, stream=model)
    np.testing.assert_array_less(after[clipped], tau + atol[clipped])
    if family == "gpt":  # MHA: exactly τ / S of its old max, so exactly τ (to the logits' rounding)
        np.testing.assert_array_less(np.abs(after[clipped] - tau), atol[clipped] + tau * 4 * U)
        np.testing.assert_array_less(np.abs(after[~clipped] - before[~clipped]), atol[~clipped])
    else:
        np.testing.assert_array_less(after[~clipped], before[~clipped] + atol[~clipped])
    check_only_clipped_columns_moved(model, new, before, tau)


def check_only_clipped_columns_moved(old, new, max_LxH, tau):
    """Every leaf of `new` equals `old`'s bit for bit, but the q (per query head) and k (per kv group)
    columns of clipped heads, which are old·sqrt(τ/S) within one float32 rounding (the product; the
    scale's own sqrt and quotient: 2 more; rounding_rtol's count, margin 2). Block by block, so
    grouped MoE stacks (models/moe.py Group) are checked in model order."""
    cfg = old.cfg
    H, K = cfg.num_heads, cfg.head_dim
    G = getattr(cfg, "kv_heads", H)
    q_scale = np.sqrt(tau / np.maximum(max_LxH, tau))
    k_scale = np.sqrt(tau / np.maximum(max_LxH.reshape(-1, G, H // G).max(-1), tau))
    if cfg.name == "gpt":
        col = np.stack([q_scale, k_scale, np.ones_like(q_scale)], -1).repeat(K, -1).reshape(len(max_LxH), -1)
        expected = {"attn_qkv": col}
    else:
        expected = {"q_proj": q_scale.repeat(K, -1), "k_proj": k_scale.repeat(K, -1)}
    rtol = 2 * 3 * U
    outside = lambda m: eqx.filter(eqx.tree_at(lambda x: x.blocks, m, None), eqx.is_array)
    for a, b in zip(jax.tree.leaves(outside(old)), jax.tree.leaves(outside(new)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    pairs = list(zip(block_list(old.blocks), block_list(new.blocks), strict=True))
    for i, (block_a, block_b) in enumerate(pairs):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(eqx.filter(block_a, eqx.is_array)),
                                jax.tree.leaves(eqx.filter(block_b, eqx.is_array)), strict=True):
            names = tuple(getattr(p, "name", "") for p in path)
            col = next((c[i] for key, c in expected.items() if key == names[0]), None)
            a, b = np.asarray(a), np.asarray(b)
            if col is None:
                assert np.array_equal(a, b), (i, names)
                continue
            same = np.broadcast_to(col == 1.0, a.shape)  # weight (D, O) or bias (O,): columns last
            assert np.array_equal(a[same], b[same]), (i, names)  # unclipped heads' columns: the same bits
            np.testing.assert_allclose(b[~same], (a.astype(np.float64) * col)[~same], rtol=rtol, atol=0)


@pytest.mark.slow  # ~10 s each on the 2-core VM: two train steps compiled
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_train_step_clips_after_the_update_and_leaves_the_rest_as_the_plain_update(tiny_run, family):
    """One Muon step of the run with τ and of the same run without: the clipped run's weights are the
    plain run's but for the clipped heads' q/k columns, old·sqrt(τ/S) with S the step's max logits at
    the weights it started from (check_only_clipped_columns_moved); a clipped head's max logit at the
    new weights is (τ/S)·(the plain new weights' max), so <= τ wherever the update did not raise it."""
    import train_jax
    from utils.parallel import mesh as meshlib

    base = ("model=llama_tiny", "model.dim=32", "model.num_blocks=2", "model.num_heads=4",
            "model.num_kv_heads=2") if family == "llama" else ()
    # a scale-0.3 perturbation's logits (~5-50) at a lr where one step barely moves them
    runs = [tiny_run(*base, "optimizer=muon", "optimizer.lr_config.warmup=0", "optimizer.lr_config.lr=1e-4",
                     *tau) for tau in ((), ("optimizer.qk_clip_tau=1e9",))]
    mesh = meshlib.make_mesh(1, 1, runs[0].dataset.batch_size, devices=jax.devices()[:1])
    tokens = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch = meshlib.put_batch(tokens, meshlib.batch_sharding(mesh, 1))
    start = perturbed_model(resolve_vocab(runs[0], 64).model, seed=2)
    S = np.asarray(start(jnp.asarray(tokens[0, :, :-1]), max_logits=True)[1]["max_logit"], np.float64)
    tau = float(np.median(S))
    runs[1] = dataclasses.replace(runs[1], optimizer=dataclasses.replace(runs[1].optimizer, qk_clip_tau=tau))
    out = []
    for run in runs:
        run = resolve_vocab(run, 64)
        _, _, state, step = train_jax.init_training(run, mesh)
        state = eqx.tree_at(lambda s: s.model, state, jax.tree.map(jnp.copy, start))
        new, metrics = step(state, batch)
        out.append((jax.tree.map(np.array, eqx.filter(new.model, eqx.is_array)), metrics))
    (plain, m0), (clipped, m1) = out
    clipped_LxH = S > tau
    assert "optim/qk_clip/clipped_heads" not in m0
    assert int(m1["optim/qk_clip/clipped_heads"]) == clipped_LxH.sum() > 0
    assert float(m1["train/loss"]) == float(m0["train/loss"])  # the same forward
    static = eqx.filter(start, eqx.is_array, inverse=True)
    plain_model, clipped_model = (eqx.combine(p, static) for p in (plain, clipped))
    check_only_clipped_columns_moved(plain_model, clipped_model, S, tau)
    x = jnp.asarray(tokens[0, :, :-1])
    after, atol = reference_max_logits(clipped_model, x, stream=plain_model)
    moved, atol_moved = reference_max_logits(plain_model, x)
    if family == "gpt":  # MHA: exactly (τ/S) of the plain weights' max
        want = tau / S[clipped_LxH] * moved[clipped_LxH]
        np.testing.assert_array_less(np.abs(after[clipped_LxH] - want), atol[clipped_LxH] + atol_moved[clipped_LxH])
    limit = tau * np.maximum(moved / S, 1.0)  # τ, or τ times what the update itself added
    np.testing.assert_array_less(after[clipped_LxH], limit[clipped_LxH] + atol[clipped_LxH])


@pytest.mark.slow  # ~5 s: torch and pytorch_optimizer imported
def test_the_rescale_matches_pytorch_optimizers_muonclip():
    """Parity tier: pytorch_optimizer 4.1.0's MuonClip, given q_proj and k_proj (torch layout: rows
    head-major) and per-head max logits, with a zero gradient (Muon's update is then exactly 0: the
    step is its clip alone); ours on the same llama block's weights and logits. MHA only: MuonClip
    takes one logit per row block of each labelled weight, so it has no GQA rule to compare with.
    Why not a full Muon step beside it: its Newton–Schulz runs in bfloat16 and its lr adjustment differs
    from ours, so their updates differ by more than the clip could show; Muon's parity is Muon's test.
    rtol: its scale is (τ/max(S, τ))^0.5 by pow, ours by sqrt (each within 1 ulp), then one product
    each: 4 roundings (rounding_rtol's count), margin 2."""
    torch = pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
    MuonClip = pytest.importorskip("pytorch_optimizer", reason="parity tier: pip install -e '.[dev,parity]'").MuonClip

    cfg = tiny("llama", "model.num_kv_heads=4")
    model = perturbed_model(cfg)
    H = cfg.num_heads
    S = np.array([[50.0, 150.0, 99.0, 400.0], [101.0, 20.0, 100.0, 1e4]], np.float32)[:, :H]
    tau = 100.0
    new, _ = qk_clip.clip(model, jnp.asarray(S), tau)
    for layer in range(cfg.num_blocks):
        wq = torch.tensor(np.asarray(model.blocks.q_proj.weight_IxO[layer]).T.copy())
        wk = torch.tensor(np.asarray(model.blocks.k_proj.weight_IxO[layer]).T.copy())
        pq, pk = torch.nn.Parameter(wq), torch.nn.Parameter(wk)
        opt = MuonClip([{"params": [pq], "use_muon": True, "qk_clip": "query", "attention_name": "a"},
                        {"params": [pk], "use_muon": True, "qk_clip": "key", "attention_name": "a"}],
                       lr=0.02, weight_decay=0.0, qk_clip_threshold=tau)
        pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
        opt.step(attention_max_logits={"a": torch.tensor(S[layer])})
        for ours, theirs in ((new.blocks.q_proj.weight_IxO[layer], pq), (new.blocks.k_proj.weight_IxO[layer], pk)):
            np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy().T, rtol=2 * 4 * U, atol=0)
        unclipped = np.repeat(S[layer] <= tau, cfg.head_dim)
        np.testing.assert_array_equal(np.asarray(new.blocks.q_proj.weight_IxO[layer])[:, unclipped],
                                      pq.detach().numpy().T[:, unclipped])


def test_a_non_finite_max_clips_nothing():
    S = jnp.array([[jnp.nan, jnp.inf, 3.0, 1.0]])
    q, k = qk_clip.scales(S, 2.0, 2)
    np.testing.assert_array_equal(np.asarray(q), [[1.0, 1.0, np.sqrt(2 / 3, dtype=np.float32), 1.0]])
    np.testing.assert_array_equal(np.asarray(k), [[1.0, np.sqrt(np.float32(2 / 3))]])  # group 0's max is NaN


# --- the knob -----------------------------------------------------------------------------------


def test_the_knob_defaults_to_off_and_reads_a_number(tiny_run):
    assert tiny_run().optimizer.qk_clip_tau is None
    assert tiny_run("optimizer=muon", "optimizer.qk_clip_tau=100").optimizer.qk_clip_tau == 100.0


@pytest.mark.parametrize("overrides,message", [
    (("optimizer.qk_clip_tau=0",), r"optimizer\.qk_clip_tau=0\.0 must be a positive attention logit .*or null"),
    (("optimizer.qk_clip_tau=-3",), r"optimizer\.qk_clip_tau=-3\.0 must be a positive"),
    (("optimizer.qk_clip_tau=often",), r"optimizer\.qk_clip_tau='often' must be"),
    (("optimizer.qk_clip_tau=100", "model.lora.rank=4"),
     r"optimizer\.qk_clip_tau=100\.0 with model\.lora\.rank=4: .*; set optimizer\.qk_clip_tau=null$"),
    (("optimizer.qk_clip_tau=100", "model.attention=cudnn", "train.compute_dtype=bfloat16"),
     r"optimizer\.qk_clip_tau needs each head's largest attention logit, which model\.attention=cudnn's .*"
     r"optimizer\.qk_clip_tau=null$"),
    (("optimizer.qk_clip_tau=100", "model=llama_tiny", "model.qk_norm=true"),
     r"optimizer\.qk_clip_tau=100\.0 with model\.qk_norm=true: .*; set optimizer\.qk_clip_tau=null$"),
])
def test_bad_values_and_combinations_are_refused_in_one_line(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        tiny_run(*overrides)
    assert "\n" not in str(caught.value)


def test_auto_attention_takes_xla_where_it_would_take_cudnn(tiny_run, monkeypatch):
    """On a GPU in bfloat16 auto picks cuDNN, whose fused kernel never forms the logits: with the knob
    it picks XLA's and the header says why (a fake machine: this CPU has no GPU)."""
    monkeypatch.setattr(attention, "machine", lambda: ("gpu", "9.0"))
    plain = resolve_vocab(tiny_run("train.compute_dtype=bfloat16"), 64)
    assert plain.model.attention == "cudnn"
    run = resolve_vocab(tiny_run("train.compute_dtype=bfloat16", "optimizer.qk_clip_tau=100"), 64)
    assert run.model.attention == "xla"
    assert any(n.startswith("attention: xla (auto: optimizer.qk_clip_tau") for n in run.notes)


def test_attend_refuses_the_max_on_cudnn():
    cfg = dataclasses.replace(tiny("gpt"), attention="cudnn")
    q = jnp.zeros((1, 2, 4, 16), jnp.bfloat16)
    with pytest.raises(ConfigError, match="model.attention=cudnn's"):
        attention.attend(cfg, q, q, q, max_logits=True)
