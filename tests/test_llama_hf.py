"""Parity tier: models/llama.py against transformers' LlamaForCausalLM (grouped-query attention, tied
and untied) and Qwen2ForCausalLM (qkv biases), both ways: a random small transformers model's
state_dict -> config_from_hf + from_hf_tensors -> our logits equal transformers'; and our random
model -> hf_config + hf_tensors -> transformers' load_state_dict -> its logits equal ours.

Weights are random everywhere (norm gains and biases too: at init they are 1 and 0, which would
hide a gain or bias mapped to the wrong place), models are 2 blocks of dim 32 built offline from a
config with a fixed seed, attention is transformers' "eager" kernel, everything float32.
Tolerance: logits of O(1) (asserted) from two float32 computations that sum in different orders,
bounded by the worst case of their sums (assert_logits_close: 6.9e-5 of the logits' scale). A
transposed or swapped tensor, a rotary in the interleaved layout or a kv head mapped to the wrong
query group moves logits by > 1e-2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf_logits, random_hf_model, sum_atol

from models import llama

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

BASE = llama.LlamaConfig(dim=32, num_heads=4, num_kv_heads=2, num_blocks=2, context_length=16, vocab_size=64,
                         mlp_multiple=32, remat="full", scan_blocks=False)  # execution knobs config_from_hf keeps
CASES = {
    "llama_gqa_tied": {"model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": True},
    "llama_gqa_untied": {"model_type": "llama", "num_key_value_heads": 1, "tie_word_embeddings": False},
    "qwen2_bias": {"model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": False},
}


def hf_model(model_type: str, **config):
    """A random transformers model of the tiny shape, every parameter perturbed (seeded)."""
    return random_hf_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=80, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=16, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **config)


def ours_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens_BxT)))


def assert_logits_close(got, want):
    """Two float32 forward passes of the same network (XLA's and PyTorch's kernels): the longest sums
    feeding a logit are the MLP's down projection (its width: 80 from transformers' config, 96 = BASE's
    mlp_width; more than dim = 32 or the 16 keys), once per block (2) and once more in the head;
    counted as one sum of n = 96·3 terms at the logits' scale, each side errs by at most
    (n + 1)·u·max|logits| (sum_atol's worst case; RoPE's angles, computed apart, err by a few ulps of
    at most 15 rad: well inside it). Margin 4: the two sides, times 2. Looser than the 2e-5·scale
    this replaced (6.9e-5·scale)."""
    scale = float(np.abs(want).max())
    assert 0.5 < scale < 50, scale  # O(1): the logits are not all near zero
    n = BASE.mlp_width * (BASE.num_blocks + 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=sum_atol(n, scale, margin=4))


TOKENS = np.random.default_rng(0).integers(0, 64, (2, 16))


@pytest.mark.parametrize("case", CASES)
def test_transformers_weights_give_transformers_logits(case):
    theirs = hf_model(**CASES[case])
    cfg = llama.config_from_hf(theirs.config.to_dict(), BASE)
    assert (cfg.remat, cfg.scan_blocks, cfg.mlp_width, cfg.rope_theta) == ("full", False, 80, 500.0)
    assert cfg.qkv_bias == (case == "qwen2_bias") and cfg.tie_embeddings == CASES[case]["tie_word_embeddings"]
    tensors = {k: v.numpy() for k, v in theirs.state_dict().items()}
    ours = llama.from_hf_tensors(cfg, tensors)
    assert_logits_close(ours_logits(ours, TOKENS), hf_logits(theirs, TOKENS))


@pytest.mark.parametrize("case", CASES)
def test_our_weights_load_into_transformers_with_equal_logits(case):
    spec = CASES[case]
    cfg = dataclasses.replace(BASE, num_kv_heads=spec["num_key_value_heads"], qkv_bias=spec["model_type"] == "qwen2",
                              tie_embeddings=spec["tie_word_embeddings"], rope_theta=500.0)
    ours = llama.Llama(cfg, jax.random.PRNGKey(1))
    leaves, treedef = jax.tree.flatten(ours)
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    ours = jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    hf_config = transformers.AutoConfig.for_model(**llama.hf_config(cfg))
    assert hf_config.model_type == spec["model_type"]
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    state = {k: torch.from_numpy(v) for k, v in llama.hf_tensors(ours).items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set()), missing
    assert_logits_close(hf_logits(theirs, TOKENS), ours_logits(ours, TOKENS))
