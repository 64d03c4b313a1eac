"""Parity tier: Adam-mini against the authors' own `adam_mini.Adam_mini` (PyPI adam-mini 1.1.1),
same weights and gradients, 6 steps, ours through `make_optimizer` on a real model's parameter
tree (its labels, its default decay groups, the run's cosine schedule), the reference in float64.

The reference partitions by parameter NAME, so it is handed our weights under the names the
authors' rules were written for, unstacked per block and transposed to PyTorch's out×in: GPT's
fused head-major `attn_qkv` becomes q_proj / k_proj / v_proj (one block per head for q and k, per
row for v), its bias one "bias" vector (Adam), `wte` (per token), `wpe` (a name the reference does
not know: one block), `lm_head` (per token), the MLP under "mlp" and the attention output as
"o_proj" (per row), the LayerNorm gains (unknown names: one block each) and biases (Adam). Llama's
q_proj / k_proj (kv heads under GQA), its qk-norm gains and SwiGLU under "mlp" likewise. The
reference decays every weight whose name has no "norm"/"ln"/"bias", embeddings included: ours
runs with decay_embeddings=true for the same groups.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import EPS32, trained_params

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
adam_mini = pytest.importorskip("adam_mini", reason=REASON)

from test_parity_basics import BASE_LR, STEPS, cosine  # noqa: E402

import models  # noqa: E402
from models.gpt import GPTConfig  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402
from optimizer import make_optimizer  # noqa: E402
from optimizer.adam_mini import AdamMini, ScaleByAdamMiniState  # noqa: E402
from optimizer.diagnostics import find_states  # noqa: E402

GPT_CFG = GPTConfig(dim=16, num_heads=2, num_blocks=2, context_length=8, vocab_size=24, tie_embeddings=False)
LLAMA_CFG = LlamaConfig(dim=16, num_heads=4, num_kv_heads=2, num_blocks=2, context_length=8, vocab_size=24,
                        mlp_hidden=24, qk_norm=True, tie_embeddings=False)


def gpt_named(p, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """Our GPT's arrays under the reference's names, per block, out×in."""
    D, H, K = cfg.dim, cfg.num_heads, cfg.head_dim
    out = {"wte.weight": p.wte_VxD, "wpe.weight": p.wpe_TxD, "lm_head.weight": p.head_DxV.T,
           "ln_f.weight": p.ln_f.gain_D, "ln_f.bias": p.ln_f.bias_D}
    b = p.blocks
    for i in range(cfg.num_blocks):
        qkv_DxHx3xK = b.attn_qkv.weight_IxO[i].reshape(D, H, 3, K)  # head-major columns (models/gpt.py)
        for j, name in enumerate("qkv"):
            out[f"h.{i}.attn.{name}_proj.weight"] = qkv_DxHx3xK[:, :, j, :].reshape(D, H * K).T
        out[f"h.{i}.attn_qkv.bias"] = b.attn_qkv.bias_O[i]
        out[f"h.{i}.attn.o_proj.weight"] = b.attn_out.weight_IxO[i].T
        out[f"h.{i}.attn.o_proj.bias"] = b.attn_out.bias_O[i]
        out[f"h.{i}.mlp.c_fc.weight"] = b.mlp_in.weight_IxO[i].T
        out[f"h.{i}.mlp.c_fc.bias"] = b.mlp_in.bias_O[i]
        out[f"h.{i}.mlp.c_proj.weight"] = b.mlp_out.weight_IxO[i].T
        out[f"h.{i}.mlp.c_proj.bias"] = b.mlp_out.bias_O[i]
        for n in ("ln1", "ln2"):
            out[f"h.{i}.{n}.weight"] = getattr(b, n).gain_D[i]
            out[f"h.{i}.{n}.bias"] = getattr(b, n).bias_D[i]
    return out


def llama_named(p, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our Llama's arrays under Hugging Face's names (the reference's rules match them), out×in."""
    out = {"model.embed_tokens.weight": p.embed_VxD, "lm_head.weight": p.head_DxV.T,
           "model.norm.weight": p.final_norm.gain_D}
    b = p.blocks
    for i in range(cfg.num_blocks):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{proj}.weight"] = getattr(b, proj).weight_IxO[i].T
        for norm in ("q_norm", "k_norm"):
            out[f"model.layers.{i}.self_attn.{norm}.weight"] = getattr(b, norm).gain_D[i]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.{proj}.weight"] = getattr(b, proj).weight_IxO[i].T
        out[f"model.layers.{i}.input_layernorm.weight"] = b.attn_norm.gain_D[i]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = b.mlp_norm.gain_D[i]
    return out


def _problem(cfg, seed):
    """(params, [grads per step]) of the model: random weights of size ~1 (so decay and steps both
    show) and random gradients, each leaf scaled by its own factor so that blocks differ."""
    model = eqx.filter_eval_shape(models.build, cfg, jax.random.PRNGKey(seed))  # shapes only: drawn below
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    rng = np.random.default_rng(seed)
    draw = lambda scale: jax.tree.map(lambda x: (scale(x) * rng.normal(size=x.shape)).astype(np.float32), params)
    grads = [draw(lambda x: rng.choice([0.1, 1.0, 10.0], size=x.shape[-1:])) for _ in range(STEPS)]
    return draw(lambda x: 1.0), grads, models.param_labels(model)


def _ours(hp, params, grads, labels):
    return trained_params(make_optimizer(hp, cosine(), labels, None, BASE_LR, {}), params, grads)


def _reference(hp, named_params, named_grads, cfg):
    """The authors' Adam_mini in float64, lr = the same cosine schedule set per step by hand."""
    tensors = {k: torch.nn.Parameter(torch.tensor(np.ascontiguousarray(v), dtype=torch.float64))
               for k, v in named_params.items()}
    opt = adam_mini.Adam_mini(named_parameters=list(tensors.items()), lr=BASE_LR, betas=(hp.b1, hp.b2), eps=hp.eps,
                              weight_decay=hp.weight_decay, dim=cfg.dim, n_heads=cfg.num_heads,
                              n_kv_heads=getattr(cfg, "kv_heads", None), verbose=False)
    schedule = cosine()
    for t, g in enumerate(named_grads):
        for group in opt.param_groups:
            group["lr"] = float(schedule(t))
        for k, p in tensors.items():
            p.grad = torch.tensor(np.ascontiguousarray(g[k]), dtype=torch.float64)
        opt.step()
    return {k: v.detach().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_adam_mini_matches_the_authors_adam_mini(family):
    """Each weight after 6 steps equals the reference's to float32 rounding. Bound per weight:
    apply_updates rounds each step (<= EPS32/2 of |p|) and the update m̂/(√v̂ + eps) carries a few
    roundings of its size (<= lr·|m̂/√v̂|, at most ~4·lr here: a coordinate's |g| against its block's
    RMS, with per-column scales 0.1..10 inside the per-neuron and per-head blocks up to √(block size)
    ~ 11·lr at worst): over STEPS steps <= STEPS·EPS32·(|p| + 11) with lr <= 1e-2, ×4 room. The
    weights must also have moved far beyond it, or the comparison would say nothing."""
    cfg, named = (GPT_CFG, gpt_named) if family == "gpt" else (LLAMA_CFG, llama_named)
    hp = AdamMini(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embeddings=True)
    params, grads, labels = _problem(cfg, seed=3)
    got = named(_ours(hp, params, grads, labels), cfg)
    want = _reference(hp, named(params, cfg), [named(g, cfg) for g in grads], cfg)
    start = named(params, cfg)
    assert set(got) == set(want)
    for k in want:
        bound = 4 * STEPS * EPS32 * (np.abs(want[k]) + 11.0)
        err = np.abs(got[k].astype(np.float64) - want[k])
        assert np.all(err <= bound), f"{family} {k}: max error {err.max():.3g} (bound {bound.max():.3g})"
        assert np.abs(want[k] - start[k]).max() > 100 * bound.max(), f"{family} {k}: the weights barely moved"


def test_the_blocks_are_the_authors():
    """The partition itself, per leaf of the GPT, after one step of random gradients: the
    reference's `vmean` sizes (one per head of q and k, per row of v, o, MLP, lm_head and wte, one
    for wpe and each norm gain; Adam's v for biases) against the number of distinct values in our
    v per leaf (a query/key head's v is stored once per column of the head: repeated, one value)."""
    params, grads, labels = _problem(GPT_CFG, seed=4)
    tx = make_optimizer(AdamMini(), cosine(), labels, None, BASE_LR, {})
    state = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[1])(grads[0], params)
    ours: dict[str, int] = {}
    for s in find_states(state, ScaleByAdamMiniState):
        for path, x in jax.tree_util.tree_leaves_with_path(s.nu):
            name = ".".join(k.name for k in path if hasattr(k, "name"))
            ours[name] = len(np.unique(np.asarray(x)))  # random gradients: distinct blocks, distinct values
    tensors = {k: torch.nn.Parameter(torch.tensor(np.ascontiguousarray(v), dtype=torch.float64))
               for k, v in gpt_named(params, GPT_CFG).items()}
    opt = adam_mini.Adam_mini(named_parameters=list(tensors.items()), dim=GPT_CFG.dim, n_heads=GPT_CFG.num_heads,
                              verbose=False)
    for p in tensors.values():
        p.grad = torch.ones_like(p)
    opt.step()
    size = {k: (opt.state[p]["vmean"] if "vmean" in opt.state[p] else opt.state[p]["v"]).numel()
            for k, p in tensors.items()}
    L, H, D, V = GPT_CFG.num_blocks, GPT_CFG.num_heads, GPT_CFG.dim, GPT_CFG.vocab_size
    assert size["wte.weight"] == V and size["lm_head.weight"] == V and size["wpe.weight"] == 1
    assert size["h.0.attn.q_proj.weight"] == size["h.0.attn.k_proj.weight"] == H
    assert size["h.0.attn.v_proj.weight"] == size["h.0.attn.o_proj.weight"] == D
    assert size["h.0.mlp.c_fc.weight"] == 4 * D and size["h.0.mlp.c_proj.weight"] == D
    assert size["h.0.ln1.weight"] == 1 and size["h.0.ln1.bias"] == D
    assert ours["blocks.attn_qkv.weight_IxO"] == L * (2 * H + D)
    assert ours["blocks.attn_out.weight_IxO"] == L * D and ours["blocks.mlp_in.weight_IxO"] == L * 4 * D
    assert ours["wte_VxD"] == V and ours["head_DxV"] == V and ours["wpe_TxD"] == 1
    assert ours["blocks.ln1.gain_D"] == L and ours["blocks.ln1.bias_D"] == L * D
