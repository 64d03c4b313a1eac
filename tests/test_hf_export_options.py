"""What a `--format hf` export keeps of what came in (the parity tier: torch and transformers), on a
tiny random GPT through models.hf.save_hf (the script's flags and their refusals: tests/test_export.py):

- `dtype`: a bfloat16 export holds bfloat16 tensors, each torch's round-to-nearest of the float32
  export's, config.json says so, and transformers' logits move from the float32 export's by no more
  than the first-order effect of that rounding (the bound is derived in the test);
- `max_shard_size`: transformers' shard names and index (checked against save_pretrained's own index
  of the same model), loaded by from_pretrained and by our reader with the single file's values exactly;
- the base's dtype (models/hf_generation.py base_dtype), which a run from `model.init_from` records
  as its export's default.
"""

from __future__ import annotations

import json
import re

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import hf_logits, logits_atol, perturbed

import models
from models import hf, hf_generation, hf_shards
from trainer import inference

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

CFG = models.config_from_dict({"name": "gpt", "dim": 16, "num_heads": 2, "num_blocks": 2, "context_length": 8,
                               "vocab_size": 64})
TOKENS_BxT = np.random.default_rng(0).integers(0, 64, (2, 8))
# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most half a unit in the
# last place, 2^-9 of it (the brief's 2^-8 per weight is bfloat16's eps, twice that).
BF16_ROUNDING = 2.0**-9


@pytest.fixture(scope="module")
def model():
    """A random GPT with every array moved by 0.2·N(0, 1): no gain or bias keeps a value (1, 0) that
    bfloat16 holds exactly, so every weight's rounding counts."""
    return perturbed(eqx.filter_jit(models.build)(CFG, jax.random.PRNGKey(0)))


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def rounding_sensitivity(model) -> np.ndarray:
    """Σ_w |w · ∂logit/∂w| for every logit (B, T, V) of a float32 transformers model: rounding each
    weight w to w(1 + ε_w), |ε_w| <= δ, moves a logit by Σ_w ∂logit/∂w · w·ε_w + O(δ²) (first-order
    Taylor expansion), at most δ times this. (torch.func's Jacobian agrees with central differences;
    jax.jacrev of our GPT did not, where its jvp and vjp do: jaxlib 0.10.2's XLA:CPU miscomputes vmapped
    backward passes past 32768 elements, docs/performance.md "Vmapped backward passes on XLA:CPU".)"""
    from torch.func import functional_call, jacrev

    params = {k: v.detach() for k, v in model.named_parameters()}  # a tied head is wte, counted once
    tokens = torch.as_tensor(TOKENS_BxT)
    jac = jacrev(lambda p: functional_call(model, p, (tokens,)).logits)(params)  # each (B, T, V, *w.shape)
    return sum((j * params[k]).abs().flatten(3).sum(-1) for k, j in jac.items()).double().numpy()


def test_bfloat16_export_rounds_each_weight_and_moves_the_logits_within_the_rounding_bound(tmp_path, model):
    hf.save_hf(str(tmp_path / "f32"), model)
    written = hf.save_hf(str(tmp_path / "bf16"), model, dtype="bfloat16")
    assert written == [hf.WEIGHTS_FILE, hf.CONFIG_FILE]
    config = json.loads((tmp_path / "bf16" / hf.CONFIG_FILE).read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file

    f32, bf16 = load_file(tmp_path / "f32" / hf.WEIGHTS_FILE), load_file(tmp_path / "bf16" / hf.WEIGHTS_FILE)
    assert set(bf16) == set(f32)
    for name, x in f32.items():
        assert x.dtype == torch.float32 and bf16[name].dtype == torch.bfloat16, name
        assert torch.equal(bf16[name], x.to(torch.bfloat16)), name  # torch's own rounding of the float32 export

    ours32, ours16 = load(tmp_path / "f32"), load(tmp_path / "bf16")
    assert {p.dtype for p in ours16.parameters()} == {torch.bfloat16}  # dtype="auto" read config.json's
    want = hf_logits(ours32, TOKENS_BxT)
    got = hf_logits(ours16.float(), TOKENS_BxT)  # float32 arithmetic on the rounded weights: the rounding alone
    # First order: |Δlogit| <= 2^-9 · Σ_w |w·∂logit/∂w| (rounding_sensitivity); margin 2 for the O(δ²)
    # terms (δ = 2^-9: a relative 2e-3 of the bound) and the nonlinearities' curvature. Plus the float32
    # difference of two programs on equal weights (helpers.logits_atol; the two sides are two models).
    bound = 2 * BF16_ROUNDING * rounding_sensitivity(ours32) + logits_atol(CFG, want)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    assert np.abs(got - want).max() > 0  # the rounding did happen


def test_sharded_export_is_transformers_layout_and_loads_the_same_values(tmp_path, model):
    hf.save_hf(str(tmp_path / "one"), model)
    limit = 8000  # bytes: a block's c_attn (16·48 float32 = 3 KB) and mlp (2 × 4 KB) fill a shard or two
    written = hf.save_hf(str(tmp_path / "sharded"), model, max_shard_size=limit)
    shards = [n for n in written if n.endswith(".safetensors")]
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert hf.WEIGHTS_FILE not in written and hf.INDEX_FILE in written
    index = json.loads((tmp_path / "sharded" / hf.INDEX_FILE).read_text())

    # transformers' own save_pretrained of the same model with the same limit: the same index layout
    single = load(tmp_path / "one")
    single.save_pretrained(tmp_path / "ref", max_shard_size=limit)
    ref = json.loads((tmp_path / "ref" / hf.INDEX_FILE).read_text())
    assert sorted(index) == sorted(ref) == ["metadata", "weight_map"]
    assert index["metadata"] == ref["metadata"]  # total_size and total_parameters
    assert set(index["weight_map"]) == set(ref["weight_map"])
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in ref["weight_map"].values())
    assert set(index["weight_map"].values()) == set(shards)
    from safetensors import safe_open

    for shard in shards:  # each tensor where the index says, each shard within the limit
        with safe_open(tmp_path / "sharded" / shard, "pt") as f:
            keys = set(f.keys())
            size = sum(4 * int(np.prod(f.get_slice(k).get_shape())) for k in keys)  # float32: 4 bytes a value
        assert keys == {k for k, v in index["weight_map"].items() if v == shard}
        assert size <= limit or len(keys) == 1

    np.testing.assert_array_equal(hf_logits(load(tmp_path / "sharded"), TOKENS_BxT), hf_logits(single, TOKENS_BxT))
    ours = hf.read_tensors(str(tmp_path / "sharded"))
    for name, x in hf.read_tensors(str(tmp_path / "one")).items():
        np.testing.assert_array_equal(ours[name], x, err_msg=name)


def test_a_smaller_export_with_force_leaves_no_stale_shard(tmp_path, model):
    """--force into a sharded export's directory: the shards of the old layout are removed, the
    user's other files kept (transformers' save_pretrained cleans its directory the same way)."""
    out = tmp_path / "out"
    hf.save_hf(str(out), model, max_shard_size=8000)
    (out / "notes.txt").write_text("mine")
    hf.save_hf(str(out), model)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5GB", 1_500_000_000),
                                       ("5GiB", 5 * 2**30), ("2000000", 2_000_000), ("20kb", 20_000)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
    assert hf_shards.parse_size(text) == size
    if text[-2:].upper() in ("KB", "MB", "GB", "TB"):  # the units of huggingface_hub's parser
        from huggingface_hub.serialization._base import parse_size_to_int  # what save_pretrained parses with

        assert parse_size_to_int(text) == size


def test_the_bases_dtype_is_recorded_and_is_the_exports_default(tmp_path, model):
    """A base whose config.json says bfloat16; one whose config.json says nothing (the headers decide);
    the run's record, then (an older checkpoint) the directory, then train.param_dtype."""
    from types import SimpleNamespace

    from loaders.tokenizers import ByteTokenizer

    hf.save_hf(str(tmp_path / "bf16"), model, dtype="bfloat16")
    hf.save_hf(str(tmp_path / "f16"), model, dtype="float16")
    config = json.loads((tmp_path / "f16" / hf.CONFIG_FILE).read_text())
    del config["dtype"], config["torch_dtype"]
    (tmp_path / "f16" / hf.CONFIG_FILE).write_text(json.dumps(config))
    assert hf_generation.for_run(str(tmp_path / "bf16"), ByteTokenizer())["dtype"] == "bfloat16"
    assert hf_generation.for_run(str(tmp_path / "f16"), ByteTokenizer())["dtype"] == "float16"

    run = lambda init_from: SimpleNamespace(model=SimpleNamespace(init_from=init_from),
                                            train=SimpleNamespace(param_dtype="float32"))
    base = str(tmp_path / "bf16")
    assert inference.export_dtype("float16", run(base), {"dtype": "bfloat16"}) == ("float16", "--dtype")
    assert inference.export_dtype(None, run(base), {"dtype": "float16"})[0] == "float16"  # the record wins
    assert inference.export_dtype(None, run(base), {"dtype": None})[0] == "bfloat16"  # no record: the directory
    assert inference.export_dtype(None, run(None), None) == ("float32", "train.param_dtype")
