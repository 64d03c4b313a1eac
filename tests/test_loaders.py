"""Tokenizers, corpora and batching: fast, offline, and each test checks a property that can break."""

import os

# Before anything imports huggingface_hub, which reads these once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import hashlib
import json
import time

import numpy as np
import pytest

from loaders import corpus, tokenizers
from loaders.batching import BatchIterator, WindowDataset, tokenize_documents
from utils.errors import CheckpointError, ConfigError, DataError

UNICODE_TEXT = "naïve café — 日本語 🐍 def f(x):\n\treturn x ** 2\n"


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_roundtrips_unicode():
    tok = tokenizers.byte_tokenizer()
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 257, 256)
    ids = tok.encode(UNICODE_TEXT)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(UNICODE_TEXT.encode("utf-8"))
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode(np.append(ids, tok.eot_id)) == UNICODE_TEXT  # eot is dropped, not an error
    assert [x.tolist() for x in tok.encode_batch(["ab", ""])] == [[97, 98], []]
    # Any id < vocab_size decodes, even a cut multi-byte character.
    assert "\ufffd" in tok.decode(np.arange(tok.vocab_size))


def _small_sample():
    return [UNICODE_TEXT * 3, "import os\nimport sys\n" * 20, "the quick brown fox " * 30]


def test_bpe_tokenizer_trains_roundtrips_and_caches(tmp_path, monkeypatch):
    tok = tokenizers.bpe_tokenizer(300, _small_sample, str(tmp_path))
    assert tok.name == "bpe-300"
    assert 258 <= tok.vocab_size <= 300
    assert tok.decode([tok.eot_id]) == ""
    ids = tok.encode(UNICODE_TEXT)
    assert ids.dtype == np.int32 and ids.max() < tok.vocab_size
    assert len(ids) < len(UNICODE_TEXT.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == UNICODE_TEXT
    assert [x.tolist() for x in tok.encode_batch([UNICODE_TEXT, "fox"])] == [ids.tolist(), tok.encode("fox").tolist()]
    tok.decode(np.arange(tok.vocab_size))  # must not raise

    (cached,) = tmp_path.glob("bpe-300-*.json")
    mtime = cached.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("cache hit expected, but the BPE was retrained")

    monkeypatch.setattr(tokenizers, "_train_bpe", no_training)
    again = tokenizers.bpe_tokenizer(300, _small_sample, str(tmp_path))
    assert again.encode(UNICODE_TEXT).tolist() == ids.tolist()
    assert cached.stat().st_mtime_ns == mtime
    monkeypatch.undo()

    # A different sample (even of identical lengths) is a different tokenizer: it retrains into its own file.
    tokenizers.bpe_tokenizer(300, lambda: [t.replace("o", "0") for t in _small_sample()], str(tmp_path))
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 2


def test_bpe_vocab_too_small_names_the_knob(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.vocab_size"):
        tokenizers.bpe_tokenizer(257, _small_sample, str(tmp_path))


def test_hf_tokenizer_missing_model_fails_fast_with_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        tokenizers.hf_tokenizer("definitely/not-a-model")
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert message.startswith("tokenizer.name_or_path='definitely/not-a-model' cannot be loaded")
    assert "tokenizer=byte" in message and "\n" not in message


def test_hf_tokenizer_loads_a_local_directory(tmp_path):
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers._train_bpe(300, _small_sample())
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizers.EOT_TOKEN).save_pretrained(tmp_path)
    tok = tokenizers.hf_tokenizer(str(tmp_path))
    assert tok.name == f"hf:{tmp_path}"
    assert tok.eot_id == backend.token_to_id(tokenizers.EOT_TOKEN)
    assert tok.vocab_size == backend.get_vocab_size()
    ids = tok.encode(UNICODE_TEXT)
    assert ids.dtype == np.int32 and tok.decode(ids) == UNICODE_TEXT
    assert [x.tolist() for x in tok.encode_batch([UNICODE_TEXT])] == [ids.tolist()]


# --- corpora ------------------------------------------------------------------------------------


def _md5_is_val(key, val_fraction):
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def test_stdlib_split_is_disjoint_deterministic_and_skips_tests(monkeypatch):
    root = corpus.stdlib_root()
    monkeypatch.setattr(corpus, "_read_text", lambda path: path)  # each document is its own path: checkable
    train = corpus.stdlib_documents("train")
    val = corpus.stdlib_documents("val")
    rel_train = [os.path.relpath(p, root).replace(os.sep, "/") for p in train]
    rel_val = [os.path.relpath(p, root).replace(os.sep, "/") for p in val]

    assert train == corpus.stdlib_documents("train")  # deterministic
    assert rel_train == sorted(rel_train)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(corpus.stdlib_files())
    assert all(_md5_is_val(r, 0.05) for r in rel_val) and not any(_md5_is_val(r, 0.05) for r in rel_train)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10
    assert "os.py" in rel_train + rel_val
    for rel in rel_train + rel_val:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts), rel
    with_tests = corpus.stdlib_documents("train", include_tests=True)
    assert any("/test/" in p for p in with_tests) and set(train) < set(with_tests)


def test_stdlib_documents_are_real_source():
    val = corpus.stdlib_documents("val")
    assert val and all(isinstance(d, str) and d for d in val)
    assert any("def " in d for d in val)


def test_text_file_documents_txt_md_and_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.md").write_text("# beta")
    (tmp_path / "empty.txt").write_text("")
    lines = [json.dumps({"text": f"doc {i}", "id": i}) for i in range(200)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:100]) + "\n\n" + "\n".join(lines[100:]) + "\n")
    paths = [str(tmp_path / "**" / "*.txt"), str(tmp_path / "**" / "*.md"), str(tmp_path / "*.jsonl")]

    everything = corpus.text_file_documents(paths, "train", val_fraction=0.0)
    assert everything[:2] == ["alpha", "# beta"]
    assert everything[2:] == [f"doc {i}" for i in range(200)]

    train = corpus.text_file_documents(paths, "train", val_fraction=0.3)
    val = corpus.text_file_documents(paths, "val", val_fraction=0.3)
    assert sorted(train + val) == sorted(everything) and not set(train) & set(val)
    assert 30 < len(val) < 90
    # Line numbers count the blank line, so doc 100 is on line 102.
    expected_val = [f"doc {i}" for i in range(200) if _md5_is_val(f"c.jsonl:{i + 1 + (i >= 100)}", 0.3)]
    assert [d for d in val if d.startswith("doc ")] == expected_val
    assert corpus.text_files(paths) == [str(tmp_path / p) for p in ("a.txt", "empty.txt", "sub/b.md", "c.jsonl")]


def test_text_file_documents_errors_name_the_knob(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match="dataset.paths"):
        corpus.text_file_documents([], "train", 0.05)
    with pytest.raises(DataError, match=r"dataset.paths entry .*nothing-\*\.txt.* matches no files"):
        corpus.text_file_documents([str(tmp_path / "nothing-*.txt")], "train", 0.05)
    with pytest.raises(DataError, match="dataset.paths.*only empty files"):
        corpus.text_file_documents([str(tmp_path / "*.txt")], "train", 0.05)
    with pytest.raises(DataError, match=r"bad\.jsonl:2 has no string field dataset\.text_key='text'"):
        corpus.text_file_documents([str(tmp_path / "bad.jsonl")], "train", 0.05)
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="dataset.val_fraction=0.0 leaves split 'val' empty"):
        corpus.text_file_documents([str(tmp_path / "one.txt")], "val", 0.0)
    with pytest.raises(ConfigError, match="dataset.val_fraction"):
        corpus.text_file_documents([str(tmp_path / "bad.jsonl")], "train", 1.5)


def test_corpus_fingerprint_tracks_contents_and_extras(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one")
    first = corpus.corpus_fingerprint([str(f)], "train")
    assert first == corpus.corpus_fingerprint([str(f)], "train")
    assert first != corpus.corpus_fingerprint([str(f)], "val")
    f.write_text("one more")
    assert first != corpus.corpus_fingerprint([str(f)], "train")


# --- tokenize + windows + batches ---------------------------------------------------------------


def test_tokenize_documents_appends_eot_and_reuses_the_cache(tmp_path):
    tok = tokenizers.byte_tokenizer()
    cache = tmp_path / "cache" / "tokens.npy"
    tokens = tokenize_documents(["ab", "", "c"], tok, str(cache))
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [97, 98, 256, 256, 99, 256]
    assert cache.exists() and os.listdir(cache.parent) == ["tokens.npy"]  # no temp file left behind
    hit = tokenize_documents(["completely different"], tok, str(cache))
    assert np.asarray(hit).tolist() == tokens.tolist()  # read back, not recomputed
    assert tokenize_documents(["x"], tok).tolist() == [120, 256]  # no cache_path: always computed


def test_tokenize_documents_batches_across_calls_and_widens_dtype():
    class BigVocab:
        name, vocab_size, eot_id = "big", 70_000, 69_999

        def encode_batch(self, texts):
            return [np.array([len(t), 66_000], np.int32) for t in texts]

    tokens = tokenize_documents(["a", "bb", "ccc"], BigVocab(), docs_per_batch=2)
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [1, 66_000, 69_999, 2, 66_000, 69_999, 3, 66_000, 69_999]


def test_window_dataset_is_a_view_of_contiguous_slices():
    tokens = np.arange(103, dtype=np.uint16)
    ds = WindowDataset(tokens, window=10)
    assert len(ds) == 10  # the last 3 tokens do not fill a window
    assert np.shares_memory(ds.windows_NxW, tokens)
    got = ds.get(np.array([3, 0, 9]))
    assert got.dtype == np.int32 and got.shape == (3, 10)
    assert got.tolist() == [list(range(30, 40)), list(range(0, 10)), list(range(90, 100))]
    with pytest.raises(DataError, match="context_length"):
        WindowDataset(np.arange(9, dtype=np.uint16), window=10)


def _window_ids(batch, window):
    """Window index of every row: the test streams are arange, so a window starts at index*window."""
    return (batch[..., 0] // window).reshape(-1).tolist()


def _dataset(num_windows, window=5):
    return WindowDataset(np.arange(num_windows * window, dtype=np.uint32), window)


def test_batch_iterator_shape_dtype_and_contents():
    ds = _dataset(12, window=5)
    batch = next(BatchIterator(ds, (2, 3), seed=0, shuffle=True))
    assert batch.shape == (2, 3, 5) and batch.dtype == np.int32
    assert (np.diff(batch, axis=-1) == 1).all()  # each row is a whole window


def test_shuffled_epoch_visits_every_window_once_and_depends_on_seed():
    ds = _dataset(12)
    it = BatchIterator(ds, (4,), seed=0, shuffle=True)
    epoch0 = sum((_window_ids(next(it), 5) for _ in range(3)), [])
    assert sorted(epoch0) == list(range(12)) and epoch0 != list(range(12))
    assert it.state_dict()["epoch"] == 1
    epoch1 = sum((_window_ids(next(it), 5) for _ in range(3)), [])
    assert sorted(epoch1) == list(range(12)) and epoch1 != epoch0
    other_seed = BatchIterator(ds, (4,), seed=1, shuffle=True)
    assert sum((_window_ids(next(other_seed), 5) for _ in range(3)), []) != epoch0


def test_batch_spanning_an_epoch_boundary_takes_the_rest_from_the_next_epoch():
    ds = _dataset(10)
    it = BatchIterator(ds, (4,), seed=3, shuffle=True)
    stream = sum((_window_ids(next(it), 5) for _ in range(5)), [])  # 20 windows = exactly 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] == np.random.default_rng([3, 0]).permutation(10).tolist()
    assert stream[10:] == np.random.default_rng([3, 1]).permutation(10).tolist()
    assert it.state_dict() == {"epoch": 2, "position": 0, "num_windows": 10}


def test_unshuffled_iterator_walks_in_order_and_wraps():
    it = BatchIterator(_dataset(5), (2,), seed=0, shuffle=False)
    assert [_window_ids(next(it), 5) for _ in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]


@pytest.mark.parametrize("steps_before_save", [0, 1, 2, 3, 4, 7])
def test_resume_gives_identical_next_batches(steps_before_save):
    ds = _dataset(11)  # 11 windows, 6 per batch: most batches straddle an epoch boundary
    original = BatchIterator(ds, (2, 3), seed=7, shuffle=True)
    for _ in range(steps_before_save):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = BatchIterator(ds, (2, 3), seed=7, shuffle=True)
    resumed.load_state_dict(state)
    for _ in range(5):
        np.testing.assert_array_equal(next(resumed), next(original))


def test_resume_rejects_a_different_dataset():
    state = BatchIterator(_dataset(11), (2,), seed=0, shuffle=True).state_dict()
    with pytest.raises(CheckpointError, match="windows"):
        BatchIterator(_dataset(12), (2,), seed=0, shuffle=True).load_state_dict(state)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(process_count):
    ds = _dataset(9)
    whole = BatchIterator(ds, (2, 4), seed=5, shuffle=True)
    parts = [BatchIterator(ds, (2, 4), seed=5, shuffle=True, process_index=i, process_count=process_count)
             for i in range(process_count)]
    for _ in range(4):
        slices = [next(p) for p in parts]
        assert slices[0].shape == (2, 4 // process_count, 5)
        np.testing.assert_array_equal(np.concatenate(slices, axis=-2), next(whole))


def test_batch_size_must_divide_over_processes():
    with pytest.raises(ConfigError, match="dataset.batch_size"):
        BatchIterator(_dataset(9), (2, 3), seed=0, shuffle=True, process_index=0, process_count=2)


def test_the_loader_is_cheap_per_step():
    """The training loop calls next() every step; it must stay far below a step (~0.3 s)."""
    ds = WindowDataset(np.zeros(2_000_000, np.uint16), 257)
    it = BatchIterator(ds, (16,), seed=0, shuffle=True)
    next(it)
    start = time.perf_counter()
    for _ in range(200):
        next(it)
    assert (time.perf_counter() - start) / 200 < 0.002
