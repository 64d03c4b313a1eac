"""Data-source and tokenizer registries: each entry's knobs, the shipped yamls, and cache keys that
must not move (a changed fingerprint silently re-tokenizes, or worse, reuses, every cache)."""

import dataclasses
import hashlib
import os
import re

import pytest
import yaml

from loaders import BATCH_KNOBS, SOURCES, TOKENIZERS, DatasetConfig, dataset_config, tokenizer_config
from loaders.sources import Stdlib, TextFiles, stdlib
from loaders.tokenizers import BPE, HF, Byte, ByteTokenizer, Tokenizer
from utils.errors import ConfigError

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

# What each entry needs to pass its own check(), so an error comes from the knob under test.
REQUIRED = {"text_files": {"paths": ["data/*.txt"]}, "hf": {"name_or_path": "gpt2"}}


def _yaml(group: str, option: str) -> dict:
    with open(os.path.join(CONF, group, f"{option}.yaml")) as f:
        return yaml.safe_load(f)


def _knobs(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# --- registries: one shape for every entry ----------------------------------------------------------


@pytest.mark.parametrize("registry", [SOURCES, TOKENIZERS], ids=["sources", "tokenizers"])
def test_every_entry_has_the_registry_shape(registry):
    for name, cls in registry.items():
        assert cls.name == name  # a ClassVar, not a knob
        assert "name" not in _knobs(cls)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        assert callable(cls.check)
        if registry is SOURCES:  # text documents, or its own windows (loaders/sources/__init__.py)
            assert callable(getattr(cls, "documents", None)) or callable(getattr(cls, "windows", None)), name
        else:
            assert callable(cls.build)
    assert not set(BATCH_KNOBS) & set().union(*(_knobs(cls) for cls in SOURCES.values()))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_unknown_source_knob_names_the_knob_and_the_source(name):
    node = {"name": name, **REQUIRED.get(name, {}), "batch_size": 8, "bogus": 1}
    message = f"unknown knob dataset.bogus for dataset.name={name}: known knobs are "
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataset_config(node)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_unknown_tokenizer_knob_names_the_knob_and_the_tokenizer(name):
    node = {"name": name, **REQUIRED.get(name, {}), "bogus": 1}
    with pytest.raises(ConfigError, match=re.escape(f"unknown knob tokenizer.bogus for tokenizer.name={name}: ")):
        tokenizer_config(node)


def test_a_knob_of_another_entry_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=re.escape("unknown knob dataset.include_tests for dataset.name=text_files: "
                                                    "known knobs are paths, text_key, val_fraction")):
        dataset_config({"name": "text_files", "paths": ["a.txt"], "include_tests": True})
    with pytest.raises(ConfigError, match=re.escape("unknown knob dataset.paths for dataset.name=stdlib")):
        dataset_config({**_yaml("dataset", "stdlib"), "paths": ["a.txt"]})
    with pytest.raises(ConfigError, match=re.escape("unknown knob dataset.text_key for dataset.name=stdlib")):
        dataset_config({"name": "stdlib", "text_key": "body"})
    with pytest.raises(ConfigError, match=re.escape("unknown knob tokenizer.vocab_size for tokenizer.name=byte: "
                                                    "known knobs are none")):
        tokenizer_config({"name": "byte", "vocab_size": 300})
    with pytest.raises(ConfigError, match=re.escape("unknown knob tokenizer.sample_docs for tokenizer.name=hf")):
        tokenizer_config({"name": "hf", "name_or_path": "gpt2", "sample_docs": 10})


def test_unknown_names_list_the_choices():
    with pytest.raises(ConfigError, match=re.escape("dataset.name='hub' is unknown: choose one of "
                                                    "chat, hf, jsonl, memmap, mixture, stdlib, text_files")):
        dataset_config({"name": "hub"})
    with pytest.raises(ConfigError, match=re.escape("tokenizer.name='spm' is unknown: choose one of bpe, byte, hf")):
        tokenizer_config({"name": "spm"})


# --- the shipped yamls ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_dataset_yaml_holds_exactly_its_sources_knobs(name):
    node = _yaml("dataset", name)
    assert node["name"] == name
    assert set(node) == {"name", *BATCH_KNOBS, *_knobs(SOURCES[name])}  # no knob hidden, none missing


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_each_tokenizer_yaml_holds_exactly_its_knobs(name):
    node = _yaml("tokenizer", name)
    assert set(node) == {"name", *_knobs(TOKENIZERS[name])}


def test_the_shipped_dataset_yamls_build():
    run = dataset_config(_yaml("dataset", "stdlib"))
    assert run == DatasetConfig(name="stdlib", source=Stdlib(val_fraction=0.05, include_tests=False), batch_size=32,
                                total_batch_size=None, context_length=None, shuffle=True)
    with pytest.raises(ConfigError, match=re.escape("dataset.paths is empty: give globs")):
        dataset_config(_yaml("dataset", "text_files"))  # paths: [] until the user sets it
    d = dataset_config({**_yaml("dataset", "text_files"), "paths": ["data/*.txt"], "total_batch_size": 64})
    assert (d.name, d.source) == ("text_files", TextFiles(paths=("data/*.txt",), text_key="text", val_fraction=0.05))
    assert (d.batch_size, d.total_batch_size, d.accum_steps, d.shuffle) == (32, 64, 2, True)


def test_the_shipped_tokenizer_yamls_build():
    assert tokenizer_config(_yaml("tokenizer", "byte")) == Byte()
    assert tokenizer_config(_yaml("tokenizer", "bpe")) == BPE(vocab_size=4096, sample_docs=2000)
    assert tokenizer_config(_yaml("tokenizer", "hf")) == HF(name_or_path="gpt2")


@pytest.mark.parametrize(
    "node, knob",
    [
        ({"name": "stdlib", "val_fraction": 0.0}, "dataset.val_fraction=0.0 must be in (0, 1)"),
        ({"name": "text_files", "paths": ["a"], "val_fraction": 1}, "dataset.val_fraction=1.0 must be in (0, 1)"),
        ({"name": "stdlib", "batch_size": 0}, "dataset.batch_size=0 must be positive"),
        ({"name": "stdlib", "batch_size": 8, "total_batch_size": 12}, "dataset.total_batch_size=12 must be a positive"),
        ({"name": "stdlib", "context_length": -1}, "dataset.context_length=-1 must be positive or null"),
        ({"name": "stdlib", "include_tests": "yes"}, "dataset.include_tests='yes' must be a bool"),
        ({"name": "text_files", "paths": "a.txt"}, "dataset.paths='a.txt' must be a list"),
    ],
)
def test_bad_dataset_knobs_name_the_knob(node, knob):
    with pytest.raises(ConfigError, match=re.escape(knob)):
        dataset_config(node)


@pytest.mark.parametrize(
    "node, knob",
    [
        ({"name": "bpe", "vocab_size": 257}, "tokenizer.vocab_size=257 must be >= 258"),
        ({"name": "bpe", "sample_docs": 0}, "tokenizer.sample_docs=0 must be positive"),
        ({"name": "hf"}, "tokenizer.name_or_path is empty"),
        ({"name": "hf", "name_or_path": ""}, "tokenizer.name_or_path is empty"),
    ],
)
def test_bad_tokenizer_knobs_name_the_knob(node, knob):
    with pytest.raises(ConfigError, match=re.escape(knob)):
        tokenizer_config(node)


# --- built objects: same tokenizers, same cache keys as before the registries -----------------------


def test_tokenizer_configs_build_tokenizers(tmp_path):
    tok = Byte().build([], str(tmp_path))
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert tok.fingerprint == "40d35365b4157e81"  # pinned: every byte-token cache is keyed by it
    assert not list(tmp_path.iterdir())  # nothing to cache

    docs = ["the quick brown fox " * 30, "import os\nimport sys\n" * 20, "naïve café " * 10]
    tok = BPE(vocab_size=300, sample_docs=2).build(docs, str(tmp_path))
    assert isinstance(tok, Tokenizer) and tok.name == "bpe-300" and tok.vocab_size <= 300
    (cached,) = tmp_path.glob("bpe-300-*.json")  # cached directly under cache_dir, as before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert BPE(vocab_size=300, sample_docs=2).build(docs, str(tmp_path)).fingerprint == tok.fingerprint


# Stdlib's (train, val) keys with no files (stats aside, what every stdlib cache key holds), by include_tests.
PINNED_STDLIB_NO_FILES = {False: ("e43189044d7e57f6", "0960a7ad27c00baa"),
                          True: ("50f25c926218d8fd", "38b334ae912c97a5")}


def _pinned_key(files: list[str], knob_lines: str) -> str:
    """A split's cache key, written out here rather than computed by loaders.corpus (whose code is
    what must not move): md5 over one `path NUL size NUL mtime_ns` line per file (the only part that
    depends on the machine), then the pinned repr lines of the recipe, split and knobs; 16 hex digits."""
    h = hashlib.md5()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(knob_lines.encode())
    return h.hexdigest()[:16]


def test_stdlib_fingerprints_are_the_old_split_documents_keys(monkeypatch):
    """The old `corpus.split_documents("stdlib", ...)` keyed each split by these exact arguments,
    pinned as literals: ('split-v1', split, 'stdlib', val_fraction, include_tests), one repr a line."""
    for include_tests in (False, True):
        files = stdlib.stdlib_files(include_tests)
        train, val = Stdlib(val_fraction=0.05, include_tests=include_tests).documents()
        for split, docs in (("train", train), ("val", val)):
            pinned = f"'split-v1'\n'{split}'\n'stdlib'\n0.05\n{include_tests}\n"
            assert docs.fingerprint == _pinned_key(files, pinned), (split, include_tests)
    # With no files the key is machine-independent: pinned whole, computed once (2026) from the lines above.
    monkeypatch.setattr(stdlib, "stdlib_files", lambda include_tests=False: [])
    keys = {t: tuple(d.fingerprint for d in Stdlib(val_fraction=0.05, include_tests=t).documents())
            for t in (False, True)}
    assert keys == PINNED_STDLIB_NO_FILES


def test_text_files_fingerprints_are_the_old_split_documents_keys(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
    paths = (str(tmp_path / "**" / "*.txt"), str(tmp_path / "sub" / "*.md"), str(tmp_path / "*.jsonl"))
    train, val = TextFiles(paths=paths, text_key="body", val_fraction=0.3).documents()
    files = [str(tmp_path / p) for p in ("a.txt", "sub/b.md", "c.jsonl")]
    # split keys relative to each glob's literal prefix; knobs pinned as literals, one repr a line
    for split, docs in (("train", train), ("val", val)):
        pinned = f"'split-v1'\n'{split}'\n'text_files'\n0.3\n'body'\n['a.txt', 'b.md', 'c.jsonl']\n"
        assert docs.fingerprint == _pinned_key(files, pinned), split
    assert train.fingerprint != val.fingerprint
