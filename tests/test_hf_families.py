"""Parity tier for the Llama family's other Hugging Face forms: rotary scaling (`rope_type` llama3 and
linear, in `rope_parameters` as transformers 5 saves it and in the older `rope_scaling` key that
Llama 3.1's hub configs use; yarn, as Qwen2.5's long-context config, and dynamic NTK), Mistral
without a sliding window (a llama with an explicit head_dim), and Qwen3 (per-head q/k RMSNorm before
rotary, head_dim apart from hidden_size/heads). Each: a random tiny transformers model saved with
save_pretrained and read by models.hf.load_hf gives transformers' logits; our model written by
save_hf and loaded by AutoModelForCausalLM gives ours, and reads back into the same arrays. Offline,
float32, 2 blocks, transformers' "eager" attention; every parameter (norm gains included) perturbed,
so a gain mapped to the wrong place shows.

The config.json files of Llama 3.1 8B, Llama 3.2 1B, Qwen3 0.6B, Mistral 7B v0.3 and Qwen2.5 7B
with its yarn block (shapes only, no weights) read into the shapes they name, with transformers'
rotary frequencies.

The rotary scaling cases run 48 positions with original_max_position_embeddings 32 and head_dim 16:
the frequencies fall in all three of llama3's bands (kept, blended, divided by factor; asserted),
and the positions past 32 are the ones the scaling exists for.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, hf_logits, random_hf_model, rounding_rtol, sum_atol

import models
from models import hf, llama
from utils.errors import ConfigError

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

VOCAB, WIDTH, BLOCKS = 64, 80, 2  # transformers' intermediate_size; our models' mlp_hidden
LLAMA_BASE = {"name": "llama", "dim": 8, "num_heads": 2, "num_blocks": 1, "context_length": 8}  # replaced by the dir's
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
LONG = 48  # positions 0..47: past original_max_position_embeddings = 32


def tokens(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, length)).astype(np.int32)


def parity_atol(want: np.ndarray, length: int) -> float:
    """atol of two float32 forward passes of one network (XLA's and torch's kernels, other summation
    orders). Sums: the longest feeding a logit are the MLP's down projections (WIDTH = 80 terms) in
    each of the 2 blocks and once more in the head, counted as one sum of n = 80·3 terms at the
    logits' scale: each side errs by at most (n + 1)·u·max|logits| (sum_atol's worst case). Rotary:
    each side's angle pos·f, pos < length, carries f's own roundings (the power, the division and
    llama3's blend: at most 8, so 8u·f) and the product's (u·pos·f), with f <= 1: at most 9u·length
    rad, and cos/sin add u; a relative turn of ε = 10u·length in q and in k moves each score, and so
    (first order, O(1) gains as the sum bound assumes) each logit by at most 2ε of its scale.
    Margin 4: the two sides, times 2."""
    scale = float(np.abs(want).max())
    assert 0.5 < scale < 50, scale  # O(1) logits: neither vanishing nor saturated
    rotary = 2 * 10 * (EPS32 / 2) * length * scale
    return sum_atol(WIDTH * (BLOCKS + 1), scale, margin=4) + 4 * rotary


def assert_parity(got: np.ndarray, want: np.ndarray) -> float:
    """Asserts `got` equals `want` within parity_atol; returns the largest error over the logits' scale."""
    # two float32 forwards: (n + 1)·u·max|logits| per side for the n = 240-term sums, plus the rotary
    # angles' 10u·length relative turn, twice (parity_atol's docstring derives it)
    np.testing.assert_allclose(got, want, rtol=0, atol=parity_atol(want, want.shape[1]))
    return float(np.abs(got - want).max() / np.abs(want).max())


def hf_model(model_type: str, **config):
    """A random transformers model (2 blocks, width 32, 4 heads on 2 kv heads), every parameter perturbed."""
    knobs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=BLOCKS, max_position_embeddings=64, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False)
    return random_hf_model(model_type, **{**knobs, **config})


def ours_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens_BxT)))


def their_inv_freq(model) -> np.ndarray:
    return model.model.rotary_emb.inv_freq.numpy()


def our_inv_freq(cfg: llama.LlamaConfig) -> np.ndarray:
    return np.asarray(llama.rotary_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.context_length))


def inv_freq_rtol() -> float:
    """Both sides compute the frequencies with the same float32 operations in the same order; the
    power and cos may round differently by an ulp in torch and XLA: at most 8 roundings (the power,
    the division, llama3's wavelength, smooth factor and blend), each EPS32/2, twice (rounding_rtol)."""
    return rounding_rtol(8)


def our_model(**knobs):
    """Our random model at the parity shape (dim 32, 4 heads on 2 kv, 2 blocks, SwiGLU 80), O(1) logits."""
    cfg = models.config_from_dict({**LLAMA_BASE, "dim": 32, "num_heads": 4, "num_kv_heads": 2, "num_blocks": BLOCKS,
                                   "mlp_hidden": WIDTH, "vocab_size": VOCAB, "tie_embeddings": False,
                                   "rope_theta": 500.0, **knobs})
    model = models.build(cfg, jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def export_and_load(tmp_path, ours, model_type: str):
    """save_hf `ours`, check config.json's model_type, load it in transformers (eager attention), and
    check the directory reads back into the same arrays."""
    assert hf.save_hf(str(tmp_path), ours) == [hf.WEIGHTS_FILE, hf.CONFIG_FILE]
    assert json.loads((tmp_path / hf.CONFIG_FILE).read_text())["model_type"] == model_type
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert theirs.config.model_type == model_type
    cfg, again = hf.load_hf(str(tmp_path), ours.cfg)
    assert cfg == ours.cfg
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return theirs


# ----------------------------------------------------------------------------- rotary scaling


def test_llama3_frequencies_span_all_three_bands():
    """The test shape exercises every branch of llama3's rule: wavelengths under original/high (8),
    between, and over original/low (32)."""
    inv = 1.0 / 500.0 ** (np.arange(0, 16, 2) / 16)
    wavelen = 2 * math.pi / inv
    assert (wavelen < 8).any() and ((wavelen >= 8) & (wavelen <= 32)).any() and (wavelen > 32).any()


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_transformers_rope_scaling_loads_with_equal_logits(tmp_path, rope):
    theirs = hf_model("llama", hidden_size=64, max_position_embeddings=128, rope_parameters=dict(rope))
    theirs.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    want = llama.RopeScaling(rope["rope_type"], rope["factor"], **(
        {"original_context_length": 32} if rope is LLAMA3 else {}))
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.head_dim, cfg.context_length) == (want, 500.0, 16, 128)
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(our_inv_freq(cfg), their_inv_freq(theirs), rtol=inv_freq_rtol(), atol=0)
    toks = tokens(LONG)
    err = assert_parity(ours_logits(ours, toks), hf_logits(theirs, toks))
    print(f"{rope['rope_type']} import: max |ours - transformers| = {err:.2e} of the logits' scale")


def test_the_older_rope_scaling_key_reads_as_transformers_reads_it(tmp_path):
    """Llama 3.1's hub config.json: `rope_scaling` (rope_type llama3) beside a top-level rope_theta, no
    rope_parameters. transformers 5 still reads it, before rope_parameters; so do we."""
    theirs = hf_model("llama", hidden_size=64, max_position_embeddings=128, rope_parameters=dict(LLAMA3))
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=500.0, rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"})
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "llama3"
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    assert cfg.rope_scaling == llama.RopeScaling("llama3", 4.0, 1.0, 4.0, 32) and cfg.rope_theta == 500.0
    toks = tokens(LONG, seed=1)
    assert_parity(ours_logits(ours, toks), hf_logits(reloaded, toks))


@pytest.mark.parametrize("scaling", [
    {"type": "llama3", "factor": 4.0, "original_context_length": 32},
    {"type": "linear", "factor": 2.0},
], ids=["llama3", "linear"])
def test_our_rope_scaling_loads_in_transformers_with_equal_logits(tmp_path, scaling):
    ours = our_model(dim=64, context_length=128, rope_scaling=scaling)
    theirs = export_and_load(tmp_path, ours, "llama")
    assert theirs.config.rope_parameters["rope_type"] == scaling["type"]
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(our_inv_freq(ours.cfg), their_inv_freq(theirs), rtol=inv_freq_rtol(), atol=0)
    toks = tokens(LONG, seed=2)
    err = assert_parity(hf_logits(theirs, toks), ours_logits(ours, toks))
    print(f"{scaling['type']} export: max |transformers - ours| = {err:.2e} of the logits' scale")


# yarn as Qwen2.5's long-context config sets it (factor 4 over its original context), with the
# original context 32 and max_position_embeddings 128 = 4·32 (transformers' consistent form); dynamic
# NTK with max_position_embeddings 32, read by a run whose model.context_length is 64 (DYNAMIC_BASE).
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 32}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}
DYNAMIC_BASE = {**LLAMA_BASE, "context_length": 64}
# yarn's other knobs off their defaults: a ramp that is not truncated, other betas, DeepSeek's mscale pair
YARN_KNOBS = {**YARN, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False, "mscale": 0.7, "mscale_all_dim": 1.0}


def cos_sin_atol(attention_factor: float, length: int) -> float:
    """atol of transformers' and our cos/sin at positions < length: each side's frequency f <= 1
    carries at most 8 roundings (yarn: the power, two reciprocals, the factor's product, the ramp's
    difference and quotient, the blend's two products and sum, counted as 8 of the rotary bound in
    parity_atol) and the angle pos·f one more: 9·u·length rad per side, cos/sin one u more; times
    the attention factor (<= 1.2 here), whose product adds one u of the value. Margin 2."""
    return 2 * 2 * attention_factor * (9 * length + 2) * EPS32 / 2


@pytest.mark.parametrize("rope, max_positions", [(YARN, 128), (YARN_KNOBS, 128), (DYNAMIC, 32)],
                         ids=["yarn", "yarn_knobs", "dynamic"])
def test_rotary_embedding_equals_transformers_past_the_original_context(rope, max_positions):
    """transformers' LlamaRotaryEmbedding and our rotary_cos_sin over LONG = 48 positions, past the
    original context of 32: frequencies and cos/sin (yarn's attention factor included). The yarn
    cases populate its ramp's three parts (kept, blended, divided); dynamic's base has grown."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                      max_position_embeddings=max_positions, rope_parameters=dict(rope))
    rotary = LlamaRotaryEmbedding(config)
    with torch.no_grad():  # a forward of LONG positions: dynamic recomputes its frequencies for it here
        cos, sin = (x[0].numpy() for x in rotary(torch.zeros(1, LONG, 64), torch.arange(LONG)[None]))
    shape = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
             "intermediate_size": 8, "vocab_size": 8, "max_position_embeddings": max_positions}
    scaling = llama.config_from_hf({**shape, "rope_parameters": dict(rope)},
                                   models.config_from_dict(DYNAMIC_BASE)).rope_scaling  # read as config.json is
    assert scaling.type == rope["rope_type"]
    ours = np.asarray(llama.rotary_inv_freq(16, 500.0, scaling, 128, seq_len=LONG))
    plain = 1.0 / 500.0 ** (np.arange(0, 16, 2) / 16)
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(ours, rotary.inv_freq.numpy(), rtol=inv_freq_rtol(), atol=0)
    ratio = plain / ours
    if rope["rope_type"] == "yarn":  # kept (ratio 1), divided (ratio factor) and blended dimensions all present
        kept, divided = np.isclose(ratio, 1, rtol=1e-5), np.isclose(ratio, 4.0, rtol=1e-5)  # 1e-5: ~100 u of slack
        assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio
    else:  # grown: every frequency but the first (i = 0: base^0) is lower than plain rotary's
        assert (ratio[1:] > 1 + 1e-3).all() and ratio[0] == 1, ratio
    factor = llama.rotary_attention_factor(scaling)
    assert factor == pytest.approx(rotary.attention_scaling, rel=EPS32)  # both float64 arithmetic of the knobs
    got_cos, got_sin = llama.rotary_cos_sin(jnp.arange(LONG), 16, 500.0, scaling, 128)
    # per side 9 roundings of the angle at positions < LONG, cos/sin and the factor's: cos_sin_atol
    atol = cos_sin_atol(factor, LONG)
    np.testing.assert_allclose(np.asarray(got_cos), cos, rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(got_sin), sin, rtol=0, atol=atol)


@pytest.mark.parametrize("model_type, rope, max_positions", [("qwen2", YARN, 128), ("llama", DYNAMIC, 32)],
                         ids=["qwen2_yarn", "llama_dynamic"])
def test_transformers_yarn_and_dynamic_load_with_equal_logits_and_export_back(tmp_path, model_type, rope,
                                                                                max_positions):
    """A random tiny Qwen2 with yarn (Qwen2.5's long-context form) and a Llama with dynamic NTK, run
    over 48 positions past the original context of 32: our logits equal transformers', the export is
    the same rotary config, and transformers computes our logits from it."""
    theirs = hf_model(model_type, hidden_size=64, max_position_embeddings=max_positions, rope_parameters=dict(rope))
    theirs.save_pretrained(tmp_path / "in")
    cfg, ours = hf.load_hf(str(tmp_path / "in"), models.config_from_dict(DYNAMIC_BASE))
    # yarn: context_length = max_position_embeddings (128); dynamic: the run's 64, past its 32
    want = (llama.RopeScaling("yarn", 4.0, original_context_length=32) if rope is YARN
            else llama.RopeScaling("dynamic", 2.0, original_context_length=32))
    assert (cfg.rope_scaling, cfg.context_length) == (want, 128 if rope is YARN else 64)
    toks = tokens(LONG, seed=6)
    want_logits = hf_logits(theirs, toks)  # dynamic: transformers' forward grows its base for 48 positions here
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(np.asarray(llama.rotary_inv_freq(16, 500.0, cfg.rope_scaling, cfg.context_length,
                                                                 seq_len=LONG)),
                               their_inv_freq(theirs), rtol=inv_freq_rtol(), atol=0)
    err = assert_parity(ours_logits(ours, toks), want_logits)
    print(f"{rope['rope_type']} import: max |ours - transformers| = {err:.2e} of the logits' scale")
    again = export_and_load(tmp_path / "out", ours, model_type)
    written = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    read = json.loads((tmp_path / "in" / hf.CONFIG_FILE).read_text())
    assert (written["rope_parameters"], written["max_position_embeddings"]) == (
        read["rope_parameters"], read["max_position_embeddings"])
    err = assert_parity(hf_logits(again, toks), ours_logits(ours, toks))
    print(f"{rope['rope_type']} export: max |transformers - ours| = {err:.2e} of the logits' scale")


def test_other_rope_types_are_refused_naming_the_key(tmp_path):
    rope = {"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 32}
    hf_model("llama", hidden_size=32, rope_parameters=rope).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    message = str(e.value)
    assert "\n" not in message and 'rope_parameters.rope_type="longrope"' in message, message


# ----------------------------------------------------------------------------- mistral


def test_transformers_mistral_loads_with_equal_logits(tmp_path):
    """sliding_window null: a llama (here with head_dim 12, apart from hidden_size/heads = 8, as Mistral Nemo)."""
    theirs = hf_model("mistral", sliding_window=None, head_dim=12)
    theirs.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    assert (cfg.name, cfg.head_size, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == ("llama", 12, 12, False, False)
    toks = tokens(32)
    err = assert_parity(ours_logits(ours, toks), hf_logits(theirs, toks))
    print(f"mistral import: max |ours - transformers| = {err:.2e} of the logits' scale")
    # ... exported, it is a llama directory that transformers computes the same logits with
    again = export_and_load(tmp_path / "out", ours, "llama")
    assert_parity(hf_logits(again, toks), ours_logits(ours, toks))


def test_mistral_window_refused_unless_it_covers_the_context(tmp_path):
    hf_model("mistral", sliding_window=16).save_pretrained(tmp_path / "short")
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(tmp_path / "short"), models.config_from_dict(LLAMA_BASE))
    message = str(e.value)
    assert "\n" not in message and "config.json sliding_window=16: attention here is always full" in message
    assert "sliding_window null" in message  # the fix
    hf_model("mistral", sliding_window=64).save_pretrained(tmp_path / "covers")  # = max_position_embeddings
    cfg, _ = hf.load_hf(str(tmp_path / "covers"), models.config_from_dict(LLAMA_BASE))
    assert cfg.context_length == 64


# ----------------------------------------------------------------------------- qwen3


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformers_qwen3_loads_with_equal_logits(tmp_path, tie):
    theirs = hf_model("qwen3", head_dim=16, tie_word_embeddings=tie)  # q_proj 32 -> 64: head_dim apart from 32/4
    theirs.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_size, cfg.tie_embeddings) == (True, False, 16, tie)
    toks = tokens(32)
    err = assert_parity(ours_logits(ours, toks), hf_logits(theirs, toks))
    print(f"qwen3 import ({'tied' if tie else 'untied'}): max |ours - transformers| = {err:.2e} of the logits' scale")


def test_our_qk_norm_model_loads_in_transformers_as_qwen3(tmp_path):
    ours = our_model(context_length=64, qk_norm=True, head_size=16)
    theirs = export_and_load(tmp_path, ours, "qwen3")
    toks = tokens(32, seed=3)
    err = assert_parity(hf_logits(theirs, toks), ours_logits(ours, toks))
    print(f"qwen3 export: max |transformers - ours| = {err:.2e} of the logits' scale")


def test_our_qwen2_with_a_head_size_loads_in_transformers(tmp_path):
    """qwen2 has no head_dim of its own in transformers' config class: the written key still sets it."""
    ours = our_model(context_length=64, qkv_bias=True, head_size=16)
    theirs = export_and_load(tmp_path, ours, "qwen2")
    toks = tokens(32, seed=5)
    assert_parity(hf_logits(theirs, toks), ours_logits(ours, toks))


def test_qwen3_with_rope_scaling_both_ways(tmp_path):
    """The two features together: QK-norm and llama3 frequencies past the original context."""
    theirs = hf_model("qwen3", head_dim=16, max_position_embeddings=128, rope_parameters=dict(LLAMA3))
    theirs.save_pretrained(tmp_path / "in")
    cfg, ours = hf.load_hf(str(tmp_path / "in"), models.config_from_dict(LLAMA_BASE))
    toks = tokens(LONG, seed=4)
    assert_parity(ours_logits(ours, toks), hf_logits(theirs, toks))
    again = export_and_load(tmp_path / "out", ours, "qwen3")
    assert_parity(hf_logits(again, toks), ours_logits(ours, toks))


# ----------------------------------------------------------------------------- released configs

# config.json of released checkpoints as their hub repositories hold them (shapes only: nothing is
# downloaded, no weights are built). Llama 3.1/3.2 carry their scaling under the older rope_scaling key.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
LLAMA_3_2_1B = {**LLAMA_3_1_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "head_dim": 64, "tie_word_embeddings": True,
                "rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "factor": 32.0}}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
    "vocab_size": 32768}
# Qwen2.5-7B-Instruct's config.json with the rope_scaling block its model card adds for 128K tokens
QWEN2_5_7B_YARN = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
RELEASED = {"llama-3.1-8b": (LLAMA_3_1_8B, 128, 8.0), "llama-3.2-1b": (LLAMA_3_2_1B, 64, 32.0),
            "qwen3-0.6b": (QWEN3_0_6B, 128, None), "mistral-7b-v0.3": (MISTRAL_7B_V03, 128, None)}


@pytest.mark.parametrize("name", RELEASED)
def test_released_configs_read_with_transformers_frequencies(name):
    """Each reads into the shape it names, and its rotary frequencies (at the real head size, theta and
    scaling) equal those of transformers' own rotary module built from the same config.json."""
    config, head_dim, factor = RELEASED[name]
    cfg = llama.config_from_hf(json.loads(json.dumps(config)), models.config_from_dict(LLAMA_BASE))
    assert (cfg.dim, cfg.head_dim, cfg.num_heads, cfg.kv_heads, cfg.context_length) == (
        config["hidden_size"], head_dim, config["num_attention_heads"], 8, config["max_position_embeddings"])
    assert cfg.qk_norm == (config["model_type"] == "qwen3") and cfg.rope_theta == config["rope_theta"]
    assert (cfg.rope_scaling and cfg.rope_scaling.factor) == factor
    theirs = their_rotary(config).inv_freq.numpy()
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(our_inv_freq(cfg), theirs, rtol=inv_freq_rtol(), atol=0)
    # ... and back: the config.json we would write describes the same frequencies to transformers
    np.testing.assert_array_equal(their_rotary(llama.hf_config(cfg)).inv_freq.numpy(), theirs)


def test_qwen2_5_yarn_config_reads_with_transformers_frequencies():
    """Qwen2.5's 128K form (yarn, factor 4 over 32768, in the older rope_scaling key with `type`): read
    by a run with model.context_length 131072, the context is the run's (yarn exists to read past
    max_position_embeddings), the frequencies and attention factor are transformers', and the
    config.json we write describes the same rotary to transformers."""
    base = models.config_from_dict({**LLAMA_BASE, "context_length": 131072})
    cfg = llama.config_from_hf(json.loads(json.dumps(QWEN2_5_7B_YARN)), base)
    assert (cfg.head_dim, cfg.kv_heads, cfg.qkv_bias, cfg.context_length) == (128, 4, True, 131072)
    assert cfg.rope_scaling == llama.RopeScaling("yarn", 4.0, original_context_length=32768)
    theirs = their_rotary(QWEN2_5_7B_YARN)
    # the same float32 operations on both sides: at most 8 roundings of EPS32/2, twice (inv_freq_rtol)
    np.testing.assert_allclose(our_inv_freq(cfg), theirs.inv_freq.numpy(), rtol=inv_freq_rtol(), atol=0)
    # 0.1·ln(4) + 1 in float64 on both sides
    assert llama.rotary_attention_factor(cfg.rope_scaling) == pytest.approx(theirs.attention_scaling, rel=EPS32)
    written = llama.hf_config(cfg)
    assert written["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 32768}
    again = their_rotary(written)
    np.testing.assert_array_equal(again.inv_freq.numpy(), theirs.inv_freq.numpy())
    assert again.attention_scaling == theirs.attention_scaling


def their_rotary(config: dict):
    """transformers' rotary module of a config.json (its model type's class), no model built."""
    import importlib

    model_type = config["model_type"]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = {"llama": "LlamaRotaryEmbedding", "mistral": "MistralRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding",
              "qwen3": "Qwen3RotaryEmbedding"}
    return getattr(modeling, rotary[model_type])(transformers.AutoConfig.for_model(**json.loads(json.dumps(config))))
