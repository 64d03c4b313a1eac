"""scripts/prepare_data.py and the memmap source (`dataset=memmap`): token files that decode back
to the corpus, do not depend on the number of workers, give the same windows as the text pipeline,
and are refused with one line (naming the knob or file) whenever they cannot be this run's data.

Offline and tiny: a dozen text files, the byte tokenizer and a 300-id HF tokenizer saved locally.
The script is called in-process (helpers.load_script), except one run of the real command line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import load_script, offline_env

from loaders import tokenizers
from loaders.config import DataRequest
from loaders.sources import SOURCES
from loaders.sources.memmap import Memmap, write_dataset
from loaders.tokenizers import bpe
from loaders.tokenizers.byte import ByteTokenizer
from loaders.tokens import cached_windows
from utils.errors import ConfigError, DataError

prepare_data = load_script("prepare_data")

WINDOW = 17  # context 16 + 1
VAL_FRACTION = 0.3


def _doc(i: int) -> str:
    return f"Document {i}: naïve café ✓ — {'lorem ipsum ' * (i + 3)}\nline two of {i}, with 日本語.\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (root / f"d{i:02d}.txt").write_text(_doc(i), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A 300-id byte-level BPE saved as a Hugging Face tokenizer directory: tokenizer=hf, offline."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf_tok")
    backend = bpe._train_bpe(300, [_doc(i) for i in range(12)])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizers.EOT_TOKEN).save_pretrained(path)
    return path


def _prepare(corpus, out, *extra: str, workers: int = 1, force: bool = False) -> dict:
    """The script's own path in-process: argv -> knobs + composed run -> prepare."""
    argv = ["dataset=text_files", f"dataset.paths=[{corpus}/*.txt]", f"dataset.val_fraction={VAL_FRACTION}",
            f"out={out}", f"workers={workers}", f"force={str(force).lower()}", *extra]
    knobs, overrides = prepare_data.split_argv(argv)
    return prepare_data.prepare(prepare_data.compose_run(overrides), knobs)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """One byte-tokenized directory shared by the refusal tests (each mutates its own copy)."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    _prepare(corpus, out)
    return out


def _copy(prepared, tmp_path):
    shutil.copytree(prepared, tmp_path / "data")
    return tmp_path / "data"


def _req(tok=None, window=WINDOW, document_mask=False, cache_dir="/nonexistent") -> DataRequest:
    return DataRequest(tok or ByteTokenizer(), cache_dir, window, document_mask)


def _documents(stream, eot_id):
    """The token stream cut after every eot: one id array per document, eot dropped."""
    ends = np.flatnonzero(stream == eot_id)
    assert len(ends) and ends[-1] == len(stream) - 1, "every document, the last included, ends with eot"
    return [part[:-1] for part in np.split(np.asarray(stream), ends + 1)[:-1]]


# --- round trip, format, equivalence with the text pipeline ---------------------------------------


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_round_trip_meta_and_same_windows_as_text_pipeline(kind, corpus, hf_dir, tmp_path):
    """The .bin files decode to the split's documents, meta.json counts them, and the memmap source's
    windows are the text pipeline's (cached_windows) token for token, with and without document masks.
    hf runs 2 workers: forked workers give what the in-process text pipeline gives."""
    extra = ("tokenizer=hf", f"tokenizer.name_or_path={hf_dir}") if kind == "hf" else ()
    meta = _prepare(corpus, tmp_path / "data", *extra, workers=2 if kind == "hf" else 1)
    run = prepare_data.compose_run(["dataset=text_files", f"dataset.paths=[{corpus}/*.txt]",
                                    f"dataset.val_fraction={VAL_FRACTION}", *extra])
    train_docs, val_docs = run.dataset.source.documents()
    tok = run.tokenizer.build(train_docs, run.cache_dir)

    on_disk = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert on_disk == {k: v for k, v in meta.items() if k != "seconds"}
    assert on_disk["format_version"] == 1 and on_disk["dtype"] == "uint16" and on_disk["byteorder"] == "little"
    assert (on_disk["tokenizer"], on_disk["tokenizer_fingerprint"]) == (tok.name, tok.fingerprint)
    assert (on_disk["vocab_size"], on_disk["eot_id"]) == (tok.vocab_size, tok.eot_id)
    assert on_disk["tokenizer_config"]["name"] == kind and on_disk["dataset"]["name"] == "text_files"

    source = Memmap(path=str(tmp_path / "data"))
    for split, docs, windows in zip(("train", "val"), (train_docs, val_docs), source.windows(_req(tok))):
        stream = np.fromfile(tmp_path / "data" / f"{split}.bin", dtype="<u2")
        assert len(stream) == on_disk[f"{split}_tokens"] and on_disk[f"{split}_documents"] == len(docs) > 0
        assert [tok.decode(ids) for ids in _documents(stream, tok.eot_id)] == list(docs)

        text = cached_windows(docs, tok, str(tmp_path / "cache"), "text_files", split, WINDOW)
        assert isinstance(windows.tokens, np.memmap)  # read lazily, not loaded
        assert np.array_equal(windows.tokens, text.tokens)
        assert (len(windows), windows.max_offset) == (len(text), text.max_offset)
        idx = np.arange(len(text))[::-1]
        assert np.array_equal(windows.get(idx, 1), text.get(idx, 1))

    masked = source.windows(_req(tok, document_mask=True))[0].get(np.arange(len(text)))
    inputs_NxT = masked["tokens"][:, :-1]
    assert set(masked) == {"tokens", "loss_mask", "segment_ids"} and (inputs_NxT == tok.eot_id).any()
    assert masked["loss_mask"][inputs_NxT == tok.eot_id].sum() == 0  # no target across a document end


class _BigVocab(ByteTokenizer):
    """Byte ids plus an eot above 65535: the stream must be uint32."""

    name, vocab_size, eot_id, fingerprint = "big", 70_000, 69_999, "big-vocab"


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    docs = {"train": [_doc(i) for i in range(6)], "val": [_doc(99)]}
    meta = write_dataset(str(tmp_path / "data"), docs, _BigVocab(), workers=1)
    assert meta["dtype"] == "uint32"
    stream = np.fromfile(tmp_path / "data" / "train.bin", dtype="<u4")
    assert (tmp_path / "data" / "train.bin").stat().st_size == 4 * meta["train_tokens"] == 4 * len(stream)
    assert [ByteTokenizer().decode(ids) for ids in _documents(stream, 69_999)] == docs["train"]
    train, _ = Memmap(path=str(tmp_path / "data")).windows(_req(_BigVocab()))
    assert train.tokens.dtype == np.dtype("<u4") and train.get(np.arange(len(train))).max() == 69_999


def test_workers_do_not_change_a_byte(tmp_path):
    docs = {"train": [_doc(i) for i in range(40)], "val": [_doc(i) for i in range(40, 45)]}
    tok = ByteTokenizer()
    metas = [write_dataset(str(tmp_path / f"w{n}"), docs, tok, workers=n) for n in (1, 2)]
    assert metas[0] == metas[1]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_a_failed_run_leaves_no_dataset_behind(tmp_path):
    class Failing(ByteTokenizer):
        def encode(self, text):
            if "Document 3" in text:
                raise DataError("boom")
            return super().encode(text)

    with pytest.raises(DataError, match="boom"):
        write_dataset(str(tmp_path / "data"), {"train": [_doc(i) for i in range(6)], "val": ["x"]}, Failing(), 1)
    assert os.listdir(tmp_path) == []  # neither data/ nor the hidden temporary directory


# --- refusals -------------------------------------------------------------------------------------


def test_registered_and_path_resolved_at_the_boundary(tiny_run, tmp_path, monkeypatch):
    assert SOURCES["memmap"] is Memmap
    monkeypatch.chdir(tmp_path)
    assert tiny_run("dataset=memmap", "dataset.path=data/owt").dataset.source.path == str(tmp_path / "data/owt")
    with pytest.raises(ConfigError, match=r"^dataset\.path is empty"):
        tiny_run("dataset=memmap")


def test_refuses_a_missing_or_incomplete_directory(prepared, tmp_path):
    with pytest.raises(DataError, match=r"^dataset\.path=.*nope is not a directory.*prepare_data"):
        Memmap(path=str(tmp_path / "nope")).windows(_req())
    data = _copy(prepared, tmp_path)
    (data / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val\.bin is missing.*re-run"):
        Memmap(path=str(data)).windows(_req())
    (data / "meta.json").unlink()
    with pytest.raises(DataError, match=r"meta\.json is missing"):
        Memmap(path=str(data)).windows(_req())


def test_refuses_another_tokenizer_naming_both_and_the_knobs(prepared, hf_dir):
    other = tokenizers.hf_tokenizer(str(hf_dir))
    with pytest.raises(DataError) as info:
        Memmap(path=str(prepared)).windows(_req(other))
    message = str(info.value)
    assert "'byte'" in message and repr(other.name) in message and "run with tokenizer=byte" in message
    assert "re-run python scripts/prepare_data.py" in message and "\n" not in message


def test_refuses_a_size_vocab_or_version_that_does_not_match_meta(prepared, tmp_path):
    data = _copy(prepared, tmp_path)
    with open(data / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(DataError, match=r"train\.bin has \d+ bytes but meta\.json says \d+ uint16 tokens"):
        Memmap(path=str(data)).windows(_req())

    meta = json.loads((prepared / "meta.json").read_text())
    for field, value, match in (("vocab_size", 300, r"vocab_size=300 but tokenizer 'byte' has 257"),
                                ("format_version", 0, r"format_version=0, this eqtrain reads 1")):
        (data / "meta.json").write_text(json.dumps({**meta, field: value}))
        with pytest.raises(DataError, match=match):
            Memmap(path=str(data)).windows(_req())


def test_refuses_a_split_shorter_than_one_window(prepared):
    val_tokens = json.loads((prepared / "meta.json").read_text())["val_tokens"]
    with pytest.raises(DataError, match=r"val\.bin holds \d+ tokens, fewer than one window.*dataset\.val_fraction"):
        Memmap(path=str(prepared)).windows(_req(window=val_tokens + 1))


def test_prepare_refuses_existing_out_bpe_and_sources_without_text(corpus, prepared, tmp_path):
    with pytest.raises(ConfigError, match=r"^out=.* already exists: pass force=true"):
        _prepare(corpus, prepared)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"^out=.*mine exists and was not written by prepare_data"):
        _prepare(corpus, tmp_path / "mine", force=True)
    assert (tmp_path / "mine" / "notes.txt").exists()
    with pytest.raises(ConfigError, match=r"^tokenizer=bpe is trained on the corpus.*tokenizer=byte or tokenizer=hf"):
        _prepare(corpus, tmp_path / "new", "tokenizer=bpe")
    with pytest.raises(ConfigError, match=r"^out is missing"):
        prepare_data.split_argv(["dataset=stdlib"])
    with pytest.raises(ConfigError, match=r"^workers=0 must be a positive integer"):
        prepare_data.split_argv(["out=x", "workers=0"])
    assert prepare_data.main(["dataset=memmap", "dataset.path=x", f"out={tmp_path / 'y'}"]) == 2
    assert not (tmp_path / "new").exists() and not (tmp_path / "y").exists()
    # Chat's loss mask does not fit token files: dataset=memmap would train the user turns too.
    (tmp_path / "c.jsonl").write_text('{"prompt": "q", "response": "a"}\n' * 20)
    argv = ["dataset=chat", "dataset.path=json", f"dataset.data_files=[{tmp_path / 'c.jsonl'}]",
            f"out={tmp_path / 'z'}"]
    knobs, overrides = prepare_data.split_argv(argv)
    with pytest.raises(ConfigError,
                       match=r"^dataset=chat trains on part of each record .*train it with dataset=chat") as info:
        prepare_data.prepare(prepare_data.compose_run(overrides), knobs)
    assert "\n" not in str(info.value) and not (tmp_path / "z").exists()

    data = _copy(prepared, tmp_path)  # force=true replaces an earlier output, whole
    (data / "stale").write_text("")
    meta = _prepare(corpus, data, force=True)
    assert sorted(os.listdir(data)) == ["meta.json", "train.bin", "val.bin"]
    assert (data / "train.bin").read_bytes() == (prepared / "train.bin").read_bytes() and meta["train_tokens"]


def test_the_command_line_as_typed(corpus, tmp_path):
    """Relative paths from the working directory, 2 workers, the summary on stdout."""
    shutil.copytree(corpus, tmp_path / "corpus")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "prepare_data.py")
    proc = subprocess.run(
        [sys.executable, script, "dataset=text_files", "dataset.paths=[corpus/*.txt]",
         f"dataset.val_fraction={VAL_FRACTION}", "out=data/x", "workers=2"],
        cwd=tmp_path, env=offline_env(tmp_path / "cache"), capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote data/x: train ") and "tokens/s with 2 workers" in proc.stdout
    assert "train with: python train_jax.py dataset=memmap dataset.path=data/x tokenizer=byte" in proc.stdout
    assert "train: 10/10 documents" in proc.stderr and "val: 2/2 documents" in proc.stderr  # the progress line
    train, val = Memmap(path=str(tmp_path / "data" / "x")).windows(_req())
    assert len(train) and len(val)
    assert sorted(os.listdir(tmp_path / "data")) == ["x"]  # no temporary directory left beside it
