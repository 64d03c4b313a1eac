"""The Hugging Face round trip against transformers itself (the parity tier: torch + transformers):
a random small transformers model saved with save_pretrained and loaded by us (models.hf.load_hf)
computes the same logits; ours written by save_hf and loaded by AutoModelForCausalLM computes the
same logits; a BPE tokenizer written beside it encodes to the same ids; `export --format hf` of a
real checkpoint loads in transformers; a run with `model.init_from=<relative dir>` starts at the
loss transformers computes on its validation windows. gpt2 here; llama (GQA, tied and untied) and
qwen2 (qkv bias) through the same directory layer. Built offline from configs: nothing downloaded.

Tolerance (every logits comparison): float32 has eps = 1.2e-7; each logit is a chain of ~10
roundings per block (norms, D=32..64-long dot products summed in different orders by XLA and
torch), so the two sides differ by ~eps·sqrt(D)·10·L ≈ 2e-5 of the logits' scale. 1e-4 of that
scale leaves a margin of ~5x, and any layout error (a transposed matrix, a head order) moves the
logits by O(their scale), ~1e4 times the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, load_script

import models
from models import hf

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-4  # of the logits' scale (module docstring)
VOCAB = 96
GPT_BASE = {"name": "gpt", "dim": 8, "num_heads": 2, "num_blocks": 1, "context_length": 8}  # replaced by the dir's
LLAMA_BASE = {"name": "llama", "dim": 8, "num_heads": 2, "num_blocks": 1, "context_length": 8}


def tokens(batch=2, length=12, vocab=VOCAB, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def hf_logits(model, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()


def assert_logits_close(got, want) -> None:
    scale = float(np.abs(want).max())
    assert scale > 0.5, "logits too small for the comparison to mean anything"
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * scale)


def gpt2_config(tie: bool, **kw):
    # initializer_range 0.2 (GPT-2's 0.02 gives logits ~0.05: every layout error would hide in the tolerance)
    knobs = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tie,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**knobs, **kw})


def llama_config(kind: str):
    """(transformers config) of a tiny llama with GQA (tied or untied) or qwen2 (qkv biases)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2, rms_norm_eps=1e-5,
                  bos_token_id=0, eos_token_id=0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    return transformers.LlamaConfig(**common, tie_word_embeddings=kind == "llama_tied")


def random_hf(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norm gains start at 0 / 1: draw them too, so their layout is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def randomized(model, seed=1, std=0.3):
    """Every array of our model redrawn at a scale that gives O(1) logits (init's 0.02 gives ~0.05)."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


# ----------------------------------------------------------------------------- transformers -> ours


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_transformers_gpt2_loads_with_equal_logits(tmp_path, tie):
    ref = random_hf(gpt2_config(tie))
    ref.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(GPT_BASE))
    assert (cfg.dim, cfg.num_heads, cfg.num_blocks, cfg.context_length, cfg.vocab_size, cfg.tie_embeddings) == (
        32, 4, 2, 32, VOCAB, tie)
    assert_logits_close(np.asarray(ours(jnp.asarray(tokens()))), hf_logits(ref, tokens()))


def test_sharded_directory_loads(tmp_path):
    """A directory saved in shards (model.safetensors.index.json) reads like one file."""
    ref = random_hf(gpt2_config(True))
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / hf.INDEX_FILE).exists() and not (tmp_path / hf.WEIGHTS_FILE).exists()
    _, ours = hf.load_hf(str(tmp_path), models.config_from_dict(GPT_BASE))
    assert_logits_close(np.asarray(ours(jnp.asarray(tokens()))), hf_logits(ref, tokens()))


@pytest.mark.parametrize("kind", ["llama_gqa_untied", "llama_tied", "qwen2"])
def test_transformers_llama_family_loads_with_equal_logits(tmp_path, kind):
    ref = random_hf(llama_config(kind))
    ref.save_pretrained(tmp_path)
    cfg, ours = hf.load_hf(str(tmp_path), models.config_from_dict(LLAMA_BASE))
    assert (cfg.name, cfg.num_kv_heads, cfg.qkv_bias, cfg.tie_embeddings) == (
        "llama", 2, kind == "qwen2", kind == "llama_tied")
    assert_logits_close(np.asarray(ours(jnp.asarray(tokens()))), hf_logits(ref, tokens()))


# ----------------------------------------------------------------------------- ours -> transformers


def our_model(family_base: dict, **knobs):
    cfg = models.config_from_dict({**family_base, "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 32,
                                   "vocab_size": VOCAB, **knobs})
    return randomized(models.build(cfg, jax.random.PRNGKey(0)))


@pytest.mark.parametrize("family_base,knobs,model_type", [
    (GPT_BASE, {"tie_embeddings": True}, "gpt2"),
    (GPT_BASE, {"tie_embeddings": False}, "gpt2"),
    (LLAMA_BASE, {"num_kv_heads": 2, "tie_embeddings": False}, "llama"),
    (LLAMA_BASE, {"num_kv_heads": 2, "tie_embeddings": True}, "llama"),
    (LLAMA_BASE, {"num_kv_heads": 2, "qkv_bias": True}, "qwen2"),
], ids=["gpt2_tied", "gpt2_untied", "llama_gqa_untied", "llama_gqa_tied", "qwen2"])
def test_ours_loads_in_transformers_with_equal_logits(tmp_path, family_base, knobs, model_type):
    ours = our_model(family_base, **knobs)
    written = hf.save_hf(str(tmp_path), ours)
    assert written == [hf.WEIGHTS_FILE, hf.CONFIG_FILE]  # no tokenizer given: none written
    assert json.loads((tmp_path / hf.CONFIG_FILE).read_text())["model_type"] == model_type
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_logits_close(hf_logits(theirs, tokens()), np.asarray(ours(jnp.asarray(tokens()))))
    # ... and back: the directory we wrote loads into the same arrays.
    _, again = hf.load_hf(str(tmp_path), ours.cfg)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def bpe():
    from loaders.tokenizers import BPETokenizer
    from loaders.tokenizers.bpe import _train_bpe

    texts = [p.read_text() for p in sorted((ROOT / "models").glob("*.py"))]
    return BPETokenizer(_train_bpe(300, texts), "bpe-300")


def test_bpe_tokenizer_round_trip(tmp_path, bpe):
    """The run's BPE written beside the model: AutoTokenizer (and our tokenizer=hf) give the same ids."""
    from loaders.tokenizers import hf_tokenizer

    written = hf.save_hf(str(tmp_path), our_model(GPT_BASE, vocab_size=320), bpe)
    assert "tokenizer.json" in written
    text = 'def f(x_BxT):\n    return "héllo" + x  # ünïcode\n<|endoftext|>'
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    np.testing.assert_array_equal(auto(text, add_special_tokens=False)["input_ids"], bpe.encode(text))
    ours = hf_tokenizer(str(tmp_path))
    np.testing.assert_array_equal(ours.encode(text), bpe.encode(text))
    assert (ours.eot_id, ours.vocab_size) == (bpe.eot_id, bpe.vocab_size)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert config["eos_token_id"] == bpe.eot_id


# ----------------------------------------------------------------------------- whole runs


RUN = ("model.vocab_size=null", "train.sample_tokens=0", "train.skip_validation=true", "model.context_length=32",
       "model.remat=none", "model.scan_blocks=false", "optimizer=sgdm", "optimizer/lr_config=constant",
       "dataset=text_files", "dataset.val_fraction=0.2", "dataset.paths=[corpus.jsonl]", "tokenizer=bpe",
       "tokenizer.vocab_size=300", "tokenizer.sample_docs=50")


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory holding a small corpus (this repo's models/ source, 8 lines a document)."""
    lines = [line for f in sorted((ROOT / "models").glob("*.py")) for line in f.read_text().splitlines()
             if line.strip()]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 8])}) + "\n"
                                                   for i in range(0, len(lines), 8)))
    monkeypatch.chdir(tmp_path)  # paths relative to the working directory, as users type them
    return tmp_path


@pytest.mark.slow
def test_export_hf_of_a_run_loads_in_transformers(workdir):
    import train_jax
    from trainer.inference import restore_for_inference, run_tokenizer

    (workdir / "run").mkdir()
    train_jax.train(compose_config(*RUN, "train.max_steps=2", "checkpoint.save=true", "checkpoint.save_path=ck"),
                    str(workdir / "run"))
    assert load_script("export_model").main(["ck", "--format", "hf", "--out", "hf_out"]) == 0
    _, run, model = restore_for_inference(str(workdir / "ck"), "latest")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(workdir / "hf_out").eval()
    toks = tokens(vocab=300)
    assert_logits_close(hf_logits(theirs, toks), np.asarray(model(jnp.asarray(toks))))
    auto = transformers.AutoTokenizer.from_pretrained(workdir / "hf_out")
    tok, _ = run_tokenizer(run)
    text = "def train(run):\n    return run"
    np.testing.assert_array_equal(auto(text, add_special_tokens=False)["input_ids"], tok.encode(text))
    # from scratch: the checkpoint recorded the tokenizer's ids, written to config.json and generation_config.json
    generation = transformers.GenerationConfig.from_pretrained(workdir / "hf_out")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (tok.eot_id, tok.eot_id, None)
    assert theirs.config.bos_token_id == theirs.config.eos_token_id == tok.eot_id


@pytest.mark.slow
def test_init_from_starts_at_the_transformers_loss(workdir, bpe):
    """model.init_from=<relative dir>: the run's step-0 weights are the file's, its tokenizer the
    directory's, and its first val/loss the mean next-token loss transformers computes on the
    same validation windows."""
    import train_jax
    from loaders.batching import eval_batches
    from utils.config import validate

    ref = random_hf(gpt2_config(True, vocab_size=320, n_positions=64))
    ref.save_pretrained(workdir / "pretrained")
    hf.save_tokenizer(str(workdir / "pretrained"), bpe)
    run = validate(compose_config(*RUN, "model.init_from=pretrained", "train.max_val_steps=2"))
    assert run.model.init_from == str(workdir / "pretrained") and (run.model.dim, run.model.context_length) == (32, 64)
    assert run.tokenizer.name_or_path == str(workdir / "pretrained")
    # the saved config (checkpoints, exports, a resume) names the tokenizer the run used
    assert run.config_dict["tokenizer"] == {"name": "hf", "name_or_path": str(workdir / "pretrained")}
    assert any("model.context_length 32 -> 64" in w for w in run.warnings)  # the header says so
    trainer = train_jax.build_trainer(run)
    _, want = hf.load_hf(run.model.init_from, run.model)
    for a, b in zip(jax.tree.leaves(trainer.state.model), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = trainer.evaluate(trainer.state.model)["val/loss"]
    nll, count = 0.0, 0.0
    for tokens_BxT1, weights_B in eval_batches(trainer.data.val, run.dataset.batch_size, run.train.max_val_steps):
        logits = hf_logits(ref, tokens_BxT1[:, :-1]).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        target = np.take_along_axis(logits, tokens_BxT1[:, 1:, None].astype(np.int64), -1)[..., 0]
        nll += float((weights_B[:, None] * (logz - target)).sum())
        count += float(weights_B.sum()) * target.shape[1]
    # a mean of O(1) losses, each within 1e-4 of its scale (module docstring)
    assert abs(got - nll / count) < RTOL * max(1.0, nll / count)
    trainer.data.close()
