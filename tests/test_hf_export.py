"""What a `--format hf` export tells transformers beyond the weights (the parity tier: transformers):
`AutoTokenizer.from_pretrained(dir)` encodes every text to the run's ids, for each model type we
write (gpt2, llama, qwen2: transformers 5 loads Qwen2Tokenizer for qwen2, whose own pre-tokenizer
splits "\\n    " in two) and each tokenizer that has a Hugging Face form (the byte tokenizer, a BPE,
a transformers tokenizer). Ids are integers: compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

import models
from models import hf, hf_tokenizer
from utils.errors import CheckpointError

transformers = pytest.importorskip("transformers", reason="parity tier: pip install -e '.[dev,parity]'")

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "gpt2": {"name": "gpt"},
    "llama": {"name": "llama", "num_kv_heads": 2},
    "qwen2": {"name": "llama", "num_kv_heads": 2, "qkv_bias": True},
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
