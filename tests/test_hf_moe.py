"""Mixture-of-Experts model types in and out of Hugging Face layout (models/hf_moe.py): mixtral,
qwen2_moe (a sigmoid-gated shared expert, qkv biases, decoder_sparse_step) and qwen3_moe (per-head
QK-norm, norm_topk_prob). The parity tier (transformers 5 with torch as the reference): a random tiny
transformers model saved with save_pretrained and read by models.hf.load_hf gives transformers'
logits, and its router aux loss (`output_router_logits=True`, padding excluded by the attention
mask) is our `load_balance_coef` × load-balance loss; our random MoE model written by save_hf loads
in AutoModelForCausalLM with equal logits and reads back into the same arrays and config; one slow
run from a mixtral directory through a checkpoint and `export_model.py --format hf`. Without torch:
config.json's MoE keys map to model.moe, and what our blocks cannot express (and what no MoE type
can hold, on export) is refused in one line naming the key or knob.

Every model: float32, 4 experts, top-2, every parameter perturbed by 0.2·N(0, 1) (norm gains and
routers included), so a tensor in the wrong place, a swapped w1/w3 or a router transposed shows.
A top-k choice that the two sides' float32 rounding could flip would make equal logits unreachable
by any tolerance; `assert_routing_decided` checks no token comes that close.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config, hf_logits, load_script, logits_atol, random_hf_model

import models
from models import hf, hf_moe, llama
from models.moe import MoEConfig, add_router_losses
from utils.config import validate
from utils.errors import ConfigError

REASON = "parity tier: pip install -e '.[dev,parity]'"
parity = pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                            reason=REASON)

VOCAB, E, K, WIDTH, SHARED = 64, 4, 2, 48, 40  # experts, top-k, experts' SwiGLU width, Qwen2-MoE's shared expert's
BASE = models.config_from_dict({"name": "llama", "dim": 8, "num_heads": 2, "num_blocks": 1, "context_length": 8})
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=K,
              router_aux_loss_coef=0.02, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
# model_type, transformers' config (beside COMMON), the model.moe it reads as
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=E, intermediate_size=WIDTH),
                MoEConfig(num_experts=E, top_k=K, renormalize=True)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=E, intermediate_size=96, moe_intermediate_size=WIDTH,
                                    shared_expert_intermediate_size=SHARED, norm_topk_prob=False),
                  MoEConfig(num_experts=E, top_k=K, renormalize=False, shared_expert_hidden=SHARED)),
    # decoder_sparse_step 2 over 4 layers: layers 1 and 3 MoE, 0 and 2 dense (intermediate_size = the experts')
    "qwen2_moe_sparse_step": ("qwen2_moe", dict(num_experts=E, intermediate_size=WIDTH, moe_intermediate_size=WIDTH,
                                                shared_expert_intermediate_size=SHARED, norm_topk_prob=True,
                                                decoder_sparse_step=2, num_hidden_layers=4, qkv_bias=False),
                              MoEConfig(num_experts=E, top_k=K, every=2, shared_expert_hidden=SHARED)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=E, intermediate_size=96, moe_intermediate_size=WIDTH, head_dim=12,
                                    norm_topk_prob=True), MoEConfig(num_experts=E, top_k=K, renormalize=True)),
    # q and k RMSNorms over all heads together (model.qk_norm_scope: all)
    "olmoe": ("olmoe", dict(num_experts=E, intermediate_size=WIDTH, norm_topk_prob=False),
              MoEConfig(num_experts=E, top_k=K, renormalize=False)),
}
# transformers' loss: router_aux_loss_coef × its load-balancing loss, k times ours pooled over the layers, no z-loss
AS_TRANSFORMERS = dict(load_balance_coef=0.02 * K, z_loss_coef=0.0, balance_pooling="global", capacity_factor=None)


def tokens(length: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, length)).astype(np.int32)


def ours_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens_BxT)))


def parity_atol(cfg, want: np.ndarray) -> float:
    """helpers.logits_atol (the longest sums feeding a logit, the MLP's, width·(num_blocks + 1) terms at
    the logits' scale, both sides, margin 4) with the widest MLP of an MoE block as the width (the
    experts' or the shared expert's) plus the top_k + 1 terms that add the routed experts and the
    shared one: at these sizes the MLP sums are longer than attention's (≤ 12 keys, heads of ≤ 12)."""
    width = max(cfg.mlp_width, cfg.moe.shared_expert_hidden) + cfg.moe.top_k + 1
    return logits_atol(dataclasses.replace(cfg, mlp_hidden=width), want)


def router_logits(theirs, tokens_BxT: np.ndarray, mask_BxT: np.ndarray | None = None):
    """transformers' output with output_router_logits=True: (each MoE layer's router logits (B·T, E), the output)."""
    import torch

    mask = None if mask_BxT is None else torch.as_tensor(mask_BxT, dtype=torch.long)
    with torch.no_grad():
        out = theirs(torch.as_tensor(tokens_BxT, dtype=torch.long), attention_mask=mask, output_router_logits=True)
    return [r.float().numpy() for r in out.router_logits], out


def assert_routing_decided(cfg, logits_per_layer, counted_N: np.ndarray | None = None) -> None:
    """Each counted token's k-th and (k+1)-th router logits lie further apart than twice the float32
    error either side's router logit can carry (parity_atol at the router logits' scale: the router's
    input comes through the same sums as the logits'), so both sides pick the same experts."""
    for layer in logits_per_layer:
        rows = layer if counted_N is None else layer[counted_N > 0]
        top = -np.sort(-rows, axis=-1)
        gap = float((top[:, K - 1] - top[:, K]).min())
        assert gap > 2 * parity_atol(cfg, layer), f"a near-tie in routing ({gap:.2e}): pick other tokens"


def our_moe_model(**knobs):
    """Our random llama with MoE on (dim 32, 4 heads on 2 kv, 2 blocks, experts of width 48): norm
    gains 1 + 0.2·N(0, 1), every other array 0.2·N(0, 1), as a perturbed init; `moe` knobs beside the
    transformers-like defaults (AS_TRANSFORMERS)."""
    moe = MoEConfig(num_experts=E, top_k=K, **{**AS_TRANSFORMERS, **knobs.pop("moe", {})})
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 4, "num_kv_heads": 2, "num_blocks": 2,
                                   "context_length": 64, "mlp_hidden": WIDTH, "vocab_size": VOCAB,
                                   "tie_embeddings": False, "rope_theta": 500.0, "norm_eps": 1e-5, **knobs,
                                   "moe": dataclasses.asdict(moe)})
    rng = np.random.default_rng(1)  # drawn in NumPy: JAX's eager init would take seconds per model

    def draw(path, x):  # norm gains about 1, everything else about 0
        gain = getattr(path[-1], "name", "") == "gain_D"
        return jnp.asarray(float(gain) + 0.2 * rng.standard_normal(x.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, models.abstract(cfg))


# ----------------------------------------------------------------------------- transformers -> ours


@parity
@pytest.mark.parametrize("case", FAMILIES)
def test_transformers_moe_loads_with_equal_logits(tmp_path, case):
    model_type, config, moe = FAMILIES[case]
    theirs = random_hf_model(model_type, **{**COMMON, **config})
    theirs.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), BASE)
    assert cfg.moe == dataclasses.replace(moe, **AS_TRANSFORMERS)
    assert (cfg.mlp_width, cfg.num_blocks, cfg.head_dim) == (WIDTH, config.get("num_hidden_layers", 2),
                                                             config.get("head_dim", 8))
    assert (cfg.qk_norm, cfg.qkv_bias) == (model_type in ("qwen3_moe", "olmoe"), model_type == "qwen2_moe" and case != (
        "qwen2_moe_sparse_step"))
    assert cfg.qk_norm_scope == ("all" if model_type == "olmoe" else "head")
    toks = tokens()
    routers, _ = router_logits(theirs, toks)
    assert len(routers) == len(cfg.moe.layers(cfg.num_blocks))  # transformers' MoE layers are ours
    assert_routing_decided(cfg, routers)
    want = hf_logits(theirs, toks)
    got = ours_logits(ours, toks)
    # float32: a logit sums width·(num_blocks + 1) products, each rounding ≤ EPS32/2 of the logits' scale
    # (sum_atol's worst case), width the widest MLP plus the top_k + 1 expert terms; both sides, margin 4
    np.testing.assert_allclose(got, want, rtol=0, atol=parity_atol(cfg, want))


@parity
@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe_sparse_step"])
def test_the_router_aux_loss_is_transformers(tmp_path, case):
    """transformers' aux_loss (padding excluded by attention_mask) × router_aux_loss_coef, the term its
    loss adds, equals the router loss our training loss adds for the same tokens (router_mask_BxT),
    named moe/load_balance_loss; ours is k times smaller, its coefficient k times larger."""
    model_type, config, _ = FAMILIES[case]
    theirs = random_hf_model(model_type, **{**COMMON, **config})
    theirs.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), BASE)
    toks = tokens(seed=1)
    mask = np.ones(toks.shape, np.int32)
    mask[1, 8:] = 0  # right padding: the counted tokens' router inputs do not see it (causal)
    routers, out = router_logits(theirs, toks, mask)
    assert_routing_decided(cfg, routers, mask.reshape(-1))
    _, stats = jax.jit(lambda m, t, r: m(t, collect=True, router_mask_BxT=r))(ours, jnp.asarray(toks),
                                                                                jnp.asarray(mask))
    total, aux = add_router_losses(jnp.zeros(()), ours, stats["moe"])
    theirs_term = theirs.config.router_aux_loss_coef * float(out.aux_loss)
    n = int(mask.sum()) * len(routers)
    # float32: f is exact (same routing, counts over n rows); P is a mean of n softmax probabilities, each off by
    # at most 2x its router logits' error (parity_atol) relatively, plus the n-term sum's and the E-term
    # product sum's roundings (n + E + 3 of EPS32/2); margin 4 for the two sides, twice
    rtol = 4 * (2 * max(parity_atol(cfg, r) for r in routers) + (n + E + 3) * EPS32 / 2)
    np.testing.assert_allclose(float(total), theirs_term, rtol=rtol)
    np.testing.assert_allclose(K * float(aux["moe"]["load_balance_loss"]), float(out.aux_loss), rtol=rtol)
    assert float(aux["moe"]["router_z_loss"]) > 0 and cfg.moe.z_loss_coef == 0  # computed, logged, not added


# ----------------------------------------------------------------------------- ours -> transformers


EXPORTS = {
    "mixtral": ({}, "mixtral"),
    "qwen2_moe": (dict(num_blocks=4, qkv_bias=True, moe={"every": 2, "renormalize": False,
                                                         "shared_expert_hidden": SHARED}), "qwen2_moe"),
    "qwen3_moe": (dict(qk_norm=True, head_size=12, moe={"renormalize": False}), "qwen3_moe"),
    "olmoe": (dict(qk_norm=True, qk_norm_scope="all"), "olmoe"),
}


@parity
@pytest.mark.parametrize("case", EXPORTS)
def test_our_moe_loads_in_transformers_with_equal_logits(tmp_path, case):
    import transformers

    knobs, model_type = EXPORTS[case]
    ours = our_moe_model(**dict(knobs))
    assert hf.save_hf(str(tmp_path), ours) == [hf.WEIGHTS_FILE, hf.CONFIG_FILE]
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert (config["model_type"], config["router_aux_loss_coef"]) == (model_type, 0.02)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert theirs.config.model_type == model_type
    cfg, again = hf.load_hf(str(tmp_path), BASE)
    assert cfg == ours.cfg
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    toks = tokens(seed=2)
    routers, _ = router_logits(theirs, toks)
    assert_routing_decided(cfg, routers)
    want = ours_logits(ours, toks)
    # float32: a logit sums width·(num_blocks + 1) products, each rounding ≤ EPS32/2 of the logits' scale
    # (sum_atol's worst case), width the widest MLP plus the top_k + 1 expert terms; both sides, margin 4
    np.testing.assert_allclose(hf_logits(theirs, toks), want, rtol=0, atol=parity_atol(cfg, want))


@parity
@pytest.mark.slow
def test_a_run_from_a_mixtral_directory_exports_as_mixtral(tmp_path, monkeypatch):
    """model.init_from=<a transformers Mixtral> -> 2 training steps -> checkpoint -> export_model.py
    --format hf: transformers loads a mixtral whose logits are the checkpoint's model's."""
    import transformers

    import train_jax
    from trainer import inference

    monkeypatch.chdir(tmp_path)
    model_type, config, _ = FAMILIES["mixtral"]
    # vocab 320: room for the run's byte tokenizer (257 ids; the directory holds no tokenizer)
    random_hf_model(model_type, **{**COMMON, **config, "vocab_size": 320}).save_pretrained(tmp_path / "base")
    (tmp_path / "run").mkdir()
    train_jax.train(compose_config(
        "model=llama_tiny", "model.init_from=base", "train.max_steps=2", "checkpoint.save=true",
        "checkpoint.save_path=ck", "train.sample_tokens=0", "train.skip_validation=true", "model.remat=none",
        "optimizer=sgdm", "optimizer/lr_config=constant", "dataset.context_length=16"), str(tmp_path / "run"))
    assert load_script("export_model").main(["ck", "--format", "hf", "--out", "out"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert theirs.config.model_type == "mixtral" and theirs.config.num_local_experts == E
    _, run, ours = inference.restore_for_inference(str(tmp_path / "ck"), "latest")
    assert run.model.moe == dataclasses.replace(FAMILIES["mixtral"][2], **AS_TRANSFORMERS)
    toks = tokens(seed=3)
    assert_routing_decided(run.model, router_logits(theirs, toks)[0])
    want = ours_logits(ours, toks)
    # float32: a logit sums width·(num_blocks + 1) products, each rounding ≤ EPS32/2 of the logits' scale
    # (sum_atol's worst case), width the widest MLP plus the top_k + 1 expert terms; both sides, margin 4
    np.testing.assert_allclose(hf_logits(theirs, toks), want, rtol=0, atol=parity_atol(run.model, want))


# ----------------------------------------------------------------------------- config.json, no torch


def mixtral_config(**edits) -> dict:
    """Our mixtral export's config.json (no torch: hf_dir_config of the model's shapes), edited."""
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 4, "num_blocks": 4, "context_length": 64,
                                   "vocab_size": VOCAB, "mlp_hidden": WIDTH,
                                   "moe": dataclasses.asdict(MoEConfig(num_experts=E, top_k=K))})
    return {**hf.hf_dir_config(models.abstract(cfg)), **edits}


def qwen_config(model_type: str, **edits) -> dict:
    hf_cfg = {k: v for k, v in mixtral_config().items() if k not in ("num_local_experts", "router_jitter_noise")}
    return {**hf_cfg, "model_type": model_type, "num_experts": E, "moe_intermediate_size": WIDTH,
            "shared_expert_intermediate_size": SHARED, **edits}


def test_config_json_maps_to_model_moe():
    """The mapping alone: experts, top-k, renormalisation, sparse step, the shared expert's width, and
    router_aux_loss_coef as k times the load-balance coefficient with layers pooled and no z-loss."""
    cfg = llama.config_from_hf(mixtral_config(router_aux_loss_coef=0.05), BASE)
    assert cfg.moe == MoEConfig(num_experts=E, top_k=K, renormalize=True, **{**AS_TRANSFORMERS,
                                                                           "load_balance_coef": 0.05 * K})
    cfg = llama.config_from_hf(qwen_config("qwen2_moe", decoder_sparse_step=2, norm_topk_prob=True), BASE)
    assert (cfg.moe.every, cfg.moe.renormalize, cfg.moe.shared_expert_hidden, cfg.qkv_bias) == (2, True, SHARED, True)
    assert cfg.moe.layers(cfg.num_blocks) == (1, 3)
    cfg = llama.config_from_hf(qwen_config("qwen3_moe", num_experts=None, num_local_experts=8), BASE)
    assert (cfg.moe.num_experts, cfg.moe.renormalize, cfg.moe.shared_expert_hidden, cfg.qk_norm) == (8, False, 0, True)


def olmoe_config(**edits) -> dict:
    hf_cfg = {k: v for k, v in mixtral_config().items() if k not in ("num_local_experts", "router_jitter_noise")}
    return {**hf_cfg, "model_type": "olmoe", "num_experts": E, **edits}


@pytest.mark.parametrize("hf_cfg,needle", [
    (lambda: mixtral_config(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (lambda: mixtral_config(num_local_experts=None), "num_local_experts is null"),
    (lambda: mixtral_config(num_experts_per_tok=8), "num_experts_per_tok=8 is more than the 4 experts"),
    (lambda: mixtral_config(router_aux_loss_coef=-1), "router_aux_loss_coef=-1: expected a number >= 0"),
    (lambda: mixtral_config(sliding_window=16), "sliding_window=16"),
    (lambda: qwen_config("qwen2_moe", mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    (lambda: qwen_config("qwen2_moe", decoder_sparse_step=3), "decoder_sparse_step=3"),
    (lambda: qwen_config("qwen2_moe", decoder_sparse_step=2, intermediate_size=96), "moe_intermediate_size=48"),
    (lambda: qwen_config("qwen2_moe", shared_expert_intermediate_size=None), "shared_expert_intermediate_size is "
                                                                             "null"),
    (lambda: qwen_config("qwen2_moe", layer_types=["full_attention", "sliding_attention"] * 2), "layer_types="),
    (lambda: qwen_config("qwen3_moe", attention_bias=True), "attention_bias=true"),
    (lambda: qwen_config("qwen3_moe", moe_intermediate_size=None), "moe_intermediate_size is null"),
    (lambda: qwen_config("qwen3_moe", num_experts=None), "num_experts is missing"),  # and no num_local_experts
    (lambda: olmoe_config(clip_qkv=8.0), "clip_qkv=8.0"),
    (lambda: olmoe_config(head_dim=12), "head_dim=12: olmoe's q norm spans hidden_size=32"),
], ids=["jitter", "no_experts", "top_k", "negative_coef", "window", "mlp_only_layers", "sparse_step", "widths",
        "no_shared_width", "sliding_layers", "qwen3_bias", "no_expert_width", "no_expert_count", "clip_qkv",
        "olmoe_head_dim"])
def test_what_our_moe_blocks_cannot_express_is_one_line(hf_cfg, needle):
    with pytest.raises(ConfigError) as e:
        llama.config_from_hf(hf_cfg(), BASE, "dir/config.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith("dir/config.json ") and needle in message, message


@pytest.mark.parametrize("knobs,needle", [
    (dict(moe={"every": 2}), "model.moe.every=2: mixtral (no QK-norm, no shared expert) has no dense blocks"),
    (dict(moe={"renormalize": False}), "model.moe.renormalize=false"),
    (dict(qkv_bias=True), "model.qkv_bias=true with MoE"),
    (dict(qk_norm=True, moe={"shared_expert_hidden": 8}), "model.moe.shared_expert_hidden=8 with model.qk_norm=true"),
    (dict(qk_norm=True, qk_norm_scope="all", moe={"every": 2}), "model.moe.every=2 with model.qk_norm_scope=all"),
    (dict(qk_norm=True, qk_norm_scope="all", head_size=16), "model.head_size=16 with model.qk_norm_scope=all"),
    (dict(qk_norm=True, qk_norm_scope="all", moe={"num_experts": 0}), "model.qk_norm_scope=all without MoE"),
], ids=["every", "renormalize", "qkv_bias", "qk_norm_and_shared", "olmoe_every", "olmoe_head_size", "dense_all"])
def test_a_model_no_moe_type_holds_is_refused_before_writing(tmp_path, knobs, needle):
    knobs = dict(knobs)
    moe = MoEConfig(**{"num_experts": E, "top_k": K, **knobs.pop("moe", {})})
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 16,
                                   "vocab_size": VOCAB, **knobs, "moe": dataclasses.asdict(moe)})
    with pytest.raises(ConfigError) as e:
        hf.save_hf(str(tmp_path / "out"), models.abstract(cfg))
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_init_from_an_moe_directory_takes_its_moe(tmp_path, monkeypatch):
    """model.init_from=<our mixtral export> on model=llama_tiny: the run's model.moe is the directory's
    (whatever the yaml's), and the run header says so; a GPT with a shared expert is refused."""
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 4, "num_kv_heads": 2, "num_blocks": 2,
                                   "context_length": 64, "vocab_size": VOCAB, "mlp_hidden": WIDTH,
                                   "moe": dataclasses.asdict(MoEConfig(num_experts=E, top_k=K))})
    hf.save_hf(str(tmp_path / "mixtral"), models.build(cfg, jax.random.PRNGKey(0)))
    monkeypatch.chdir(tmp_path)
    run = validate(compose_config("model=llama_tiny", "model.init_from=mixtral", "model.moe.num_experts=2"))
    assert run.model.moe == dataclasses.replace(cfg.moe, **{**AS_TRANSFORMERS, "load_balance_coef": 0.01})
    assert run.model.moe.balance_pooling == "global" and run.model.mlp_hidden == WIDTH
    with pytest.raises(ConfigError) as e:
        validate(compose_config("model.moe.num_experts=4", "model.moe.shared_expert_hidden=8"))
    assert "\n" not in str(e.value) and "model.moe.shared_expert_hidden=8: the shared expert" in str(e.value)


def test_flops_count_the_shared_expert_and_its_gate():
    """Per MoE block: top_k SwiGLU experts (3·d·f each), the router (d·E), the shared expert (3·d·f_s)
    and its gate (d), against the dense block's 3·d·f; 6 FLOPs per multiply-add."""
    moe = MoEConfig(num_experts=E, top_k=K, shared_expert_hidden=SHARED)
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 16,
                                   "vocab_size": VOCAB, "mlp_hidden": WIDTH, "moe": dataclasses.asdict(moe)})
    dense = dataclasses.replace(cfg, moe=MoEConfig())
    d = 32
    per_block = K * 3 * d * WIDTH + d * E + 3 * d * SHARED + d - 3 * d * WIDTH
    assert models.flops_per_token(cfg, 16) == models.flops_per_token(dense, 16) + 6 * 2 * per_block
    labels = models.param_labels(models.abstract(cfg))
    assert labels.blocks.moe.shared_gate.weight_IxO == "scalar" and labels.blocks.moe.shared.up_proj.weight_IxO == (
        "hidden")
    assert hf_moe.model_type(cfg) == "qwen2_moe"
