"""What a `--format hf` export tells transformers beyond the weights (the parity tier: transformers):
`AutoTokenizer.from_pretrained(dir)` encodes every text to the run's ids, for each model type we
write (gpt2, llama, qwen2, qwen3: transformers 5 loads Qwen2Tokenizer for qwen2, whose own pre-tokenizer
splits "\\n    " in two) and each tokenizer that has a Hugging Face form (the byte tokenizer, a BPE,
a transformers tokenizer); and the generation metadata (config.json's bos/eos/pad,
generation_config.json) is the base's for a run from `model.init_from`, through its checkpoint,
and the tokenizer's for a run from scratch. Ids are integers: compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from helpers import compose_config, load_script

import models
from models import hf, hf_generation, hf_tokenizer
from utils.errors import CheckpointError

transformers = pytest.importorskip("transformers", reason="parity tier: pip install -e '.[dev,parity]'")

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "gpt2": {"name": "gpt"},
    "llama": {"name": "llama", "num_kv_heads": 2},
    "qwen2": {"name": "llama", "num_kv_heads": 2, "qkv_bias": True},
    "qwen3": {"name": "llama", "num_kv_heads": 2, "qk_norm": True},
}
# Texts apart from models/hf_tokenizer.py's PROBES, so the export's own check is not what is tested.
TEXTS = (
    "class A:\n    def f(self):\n        return 42\n",  # the "\n    ": 1 id in our BPE, 2 in Qwen2Tokenizer
    "x = [1, 22, 333, 4444, 55555]\n\n\n\ty\r\nz",
    "naïve Ünïcödé — ελληνικά, русский, 中文, e\u0301 🙂🙂",
    "   \n\n  trailing   ",
    "a<|endoftext|>b",
)


@pytest.fixture(scope="module")
def bpe():
    from loaders.tokenizers import BPETokenizer
    from loaders.tokenizers.bpe import _train_bpe

    texts = [p.read_text() for p in sorted((ROOT / "models").glob("*.py"))]
    return BPETokenizer(_train_bpe(400, texts), "bpe-400")


def tokenizer_of(kind: str, bpe, tmp_path):
    from loaders.tokenizers import ByteTokenizer, hf_tokenizer

    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return bpe
    hf.save_tokenizer(str(tmp_path / "tok"), bpe)  # a transformers tokenizer (tokenizer=hf) of that BPE
    return hf_tokenizer(str(tmp_path / "tok"))


def export(out: Path, model_type: str, tokenizer) -> list[str]:
    cfg = models.config_from_dict({**FAMILIES[model_type], "dim": 16, "num_heads": 2, "num_blocks": 1,
                                   "context_length": 16, "vocab_size": tokenizer.vocab_size})
    return hf.save_hf(str(out), models.build(cfg, jax.random.PRNGKey(0)), tokenizer)


@pytest.mark.parametrize("kind", ["byte", "bpe", "hf"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_auto_tokenizer_gives_the_runs_ids(tmp_path, bpe, model_type, kind):
    tok = tokenizer_of(kind, bpe, tmp_path)
    written = export(tmp_path / "out", model_type, tok)
    assert json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())["model_type"] == model_type
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text).tolist(), (type(auto), text)
        assert auto.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(tok.encode(text))
    # the custom class only where the model type's own tokenizer would rewrite the pipeline
    assert (hf_tokenizer.MODULE_FILE in written) == (model_type == "qwen2")
    if model_type == "qwen2":  # trusting the directory's code loads the same pipeline
        trusted = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", trust_remote_code=True)
        assert trusted(TEXTS[0], add_special_tokens=False)["input_ids"] == tok.encode(TEXTS[0]).tolist()


def test_export_that_would_tokenize_differently_is_refused(tmp_path, bpe, monkeypatch):
    """If the pinned class did not take (another transformers), the export says so instead of
    leaving a directory that silently tokenizes differently."""
    monkeypatch.setattr(hf_tokenizer, "pin_class", lambda out_dir: [])
    with pytest.raises(CheckpointError, match=r"AutoTokenizer loads Qwen2Tokenizer, which encodes .* as \d+ ids, "
                                              r"the run's tokenizer as \d+: .*use --format safetensors") as e:
        export(tmp_path / "out", "qwen2", bpe)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- generation metadata


def hf_with_own_ids(bpe, tmp_path):
    """tokenizer=hf of a tokenizer whose bos, eos and pad are three tokens of their own (as Llama's)."""
    from transformers import PreTrainedTokenizerFast

    from loaders.tokenizers import hf_tokenizer

    PreTrainedTokenizerFast(tokenizer_object=bpe._tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>") \
        .save_pretrained(tmp_path / "own")
    return hf_tokenizer(str(tmp_path / "own"))


@pytest.mark.parametrize("kind", ["byte", "bpe", "hf_own_ids"])
def test_from_scratch_the_ids_are_the_tokenizers(tmp_path, bpe, kind):
    tok = hf_with_own_ids(bpe, tmp_path) if kind == "hf_own_ids" else tokenizer_of(kind, bpe, tmp_path)
    if kind == "hf_own_ids":
        raw = tok._tok
        want = {"bos_token_id": raw.convert_tokens_to_ids("<s>"), "eos_token_id": raw.convert_tokens_to_ids("</s>"),
                "pad_token_id": raw.convert_tokens_to_ids("<pad>")}
        assert len(set(want.values())) == 3
    else:
        want = {"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id, "pad_token_id": None}
    assert hf_generation.for_run(None, tok) == {**want, "generation_config": None, "dtype": None}  # the manifest's
    written = export(tmp_path / "out", "llama", tok)  # no manifest entry (an older checkpoint): the same ids
    assert hf_generation.FILE in written
    config = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    assert {k: config[k] for k in hf_generation.ID_KEYS} == want
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == tuple(want.values())


BASE_IDS = {"bos_token_id": 1, "eos_token_id": [0, 2], "pad_token_id": 3}
BASE_GENERATION = {"bos_token_id": 1, "eos_token_id": [0, 2], "do_sample": True, "temperature": 0.7, "top_p": 0.9,
                   "transformers_version": transformers.__version__}


@pytest.mark.slow
def test_fine_tuned_export_carries_the_bases_generation_metadata(tmp_path, bpe, monkeypatch):
    """model.init_from=<a base with bos 1, eos [0, 2], pad 3 and sampling settings> -> 2 steps ->
    checkpoint -> export --format hf: config.json and generation_config.json are the base's, though the
    run's tokenizer (the base's, a GPT-2-style BPE) would say bos = eos = its end of text."""
    import train_jax

    monkeypatch.chdir(tmp_path)
    lines = [line for f in sorted((ROOT / "models").glob("*.py")) for line in f.read_text().splitlines() if line]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 8])}) + "\n"
                                                   for i in range(0, len(lines), 8)))
    cfg = models.config_from_dict({"name": "gpt", "dim": 16, "num_heads": 2, "num_blocks": 1, "context_length": 32,
                                   "vocab_size": bpe.vocab_size})
    hf.save_hf(str(tmp_path / "base"), models.build(cfg, jax.random.PRNGKey(0)), bpe)
    config = json.loads((tmp_path / "base" / hf.CONFIG_FILE).read_text())
    (tmp_path / "base" / hf.CONFIG_FILE).write_text(json.dumps({**config, **BASE_IDS}))
    (tmp_path / "base" / hf_generation.FILE).write_text(json.dumps(BASE_GENERATION))
    (tmp_path / "run").mkdir()
    train_jax.train(compose_config(
        "model.init_from=base", "train.max_steps=2", "checkpoint.save=true", "checkpoint.save_path=ck",
        "train.sample_tokens=0", "train.skip_validation=true", "model.remat=none", "model.scan_blocks=false",
        "optimizer=sgdm", "optimizer/lr_config=constant", "dataset=text_files", "dataset.val_fraction=0.2",
        "dataset.paths=[corpus.jsonl]", "dataset.context_length=16"), str(tmp_path / "run"))
    # the base changes after the run started: the export writes what the run started from
    (tmp_path / "base" / hf_generation.FILE).write_text(json.dumps({"temperature": 1.5}))
    assert load_script("export_model").main(["ck", "--format", "hf", "--out", "out"]) == 0
    config = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    assert {k: config[k] for k in hf_generation.ID_KEYS} == BASE_IDS
    assert json.loads((tmp_path / "out" / hf_generation.FILE).read_text()) == BASE_GENERATION
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.temperature, loaded.top_p) == (1, [0, 2], 0.7, 0.9)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == [0, 2]


def test_a_malformed_manifest_entry_is_one_line():
    with pytest.raises(CheckpointError, match=r"^ck manifest generation has eos_token_id=\"2\": a token id is an "
                                              r"integer, a list of integers or null; fix the file$"):
        hf_generation.checked({"eos_token_id": "2", "generation_config": None}, "ck manifest")
    with pytest.raises(CheckpointError, match=r"^ck manifest generation is \[1\], not the object a run writes"):
        hf_generation.checked([1], "ck manifest")
