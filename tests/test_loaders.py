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
from loaders.batching import BatchIterator, eval_batches, eval_indices
from loaders.sources import Stdlib, TextFiles, stdlib, text_files
from loaders.tokenizers import bpe
from loaders.tokens import tokenize_documents
from loaders.windows import WindowDataset
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

    monkeypatch.setattr(bpe, "_train_bpe", no_training)
    again = tokenizers.bpe_tokenizer(300, _small_sample, str(tmp_path))
    assert again.encode(UNICODE_TEXT).tolist() == ids.tolist() and again.fingerprint == tok.fingerprint
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

    backend = bpe._train_bpe(300, _small_sample())
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizers.EOT_TOKEN).save_pretrained(tmp_path)
    tok = tokenizers.hf_tokenizer(str(tmp_path))
    assert tok.name == f"hf:{tmp_path}"
    assert tok.eot_id == backend.token_to_id(tokenizers.EOT_TOKEN)
    assert tok.vocab_size == backend.get_vocab_size()
    ids = tok.encode(UNICODE_TEXT)
    assert ids.dtype == np.int32 and tok.decode(ids) == UNICODE_TEXT
    assert [x.tolist() for x in tok.encode_batch([UNICODE_TEXT])] == [ids.tolist()]
    assert tok.fingerprint == tokenizers.hf_tokenizer(str(tmp_path)).fingerprint  # stable: it keys token caches
    others = {tokenizers.byte_tokenizer().fingerprint, tokenizers.BPETokenizer(backend, "bpe-300").fingerprint}
    assert tok.fingerprint not in others


# --- corpora ------------------------------------------------------------------------------------


def _md5_is_val(key, val_fraction):
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def _read(source):
    """(train, val) of a source, read now (`documents()` only lists and fingerprints)."""
    return tuple(list(split) for split in source.documents())


def test_stdlib_split_is_disjoint_deterministic_and_skips_tests(monkeypatch):
    root = stdlib.stdlib_root()
    monkeypatch.setattr(corpus, "read_text", lambda path: path)  # each document is its own path: checkable
    train, val = _read(Stdlib())
    rel_train = [os.path.relpath(p, root).replace(os.sep, "/") for p in train]
    rel_val = [os.path.relpath(p, root).replace(os.sep, "/") for p in val]

    assert train == _read(Stdlib())[0]  # deterministic
    assert rel_train == sorted(rel_train)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(stdlib.stdlib_files())
    assert all(_md5_is_val(r, 0.05) for r in rel_val) and not any(_md5_is_val(r, 0.05) for r in rel_train)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10
    assert "os.py" in rel_train + rel_val
    for rel in rel_train + rel_val:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts), rel
    with_tests = _read(Stdlib(include_tests=True))[0]
    assert any("/test/" in p for p in with_tests) and set(train) < set(with_tests)


def test_stdlib_documents_are_real_source():
    val = list(Stdlib().documents()[1])
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

    everything = list(TextFiles(tuple(paths), val_fraction=0.0).documents()[0])
    assert everything[:2] == ["alpha", "# beta"]
    assert everything[2:] == [f"doc {i}" for i in range(200)]

    train, val = _read(TextFiles(tuple(paths), val_fraction=0.3))
    assert sorted(train + val) == sorted(everything) and not set(train) & set(val)
    assert 30 < len(val) < 90
    # Line numbers count the blank line, so doc 100 is on line 102.
    expected_val = [f"doc {i}" for i in range(200) if _md5_is_val(f"c.jsonl:{i + 1 + (i >= 100)}", 0.3)]
    assert [d for d in val if d.startswith("doc ")] == expected_val
    listed = text_files.keyed_files(paths)  # glob order, then sorted; empty files are listed (and skipped later)
    assert [path for path, _ in listed] == [str(tmp_path / p) for p in ("a.txt", "empty.txt", "sub/b.md", "c.jsonl")]


def test_text_file_documents_errors_name_the_knob(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match="dataset.paths"):
        TextFiles(()).documents()
    with pytest.raises(DataError, match=r"dataset.paths entry .*nothing-\*\.txt.* matches no files"):
        TextFiles((str(tmp_path / "nothing-*.txt"),)).documents()  # at once: listing is not deferred
    with pytest.raises(DataError, match="dataset.paths.*only empty files"):
        _read(TextFiles((str(tmp_path / "*.txt"),)))
    with pytest.raises(DataError, match=r"bad\.jsonl:2 has no string field dataset\.text_key='text'"):
        _read(TextFiles((str(tmp_path / "bad.jsonl"),)))
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="dataset.val_fraction=0.0 leaves split 'val' empty"):
        list(TextFiles((str(tmp_path / "one.txt"),), val_fraction=0.0).documents()[1])
    with pytest.raises(ConfigError, match="dataset.val_fraction"):
        TextFiles((str(tmp_path / "bad.jsonl"),), val_fraction=1.5).documents()


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

        def encode_documents(self, texts):
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
    it = BatchIterator(ds, (4,), seed=0, shuffle=True, random_offset=False)
    epoch0 = sum((_window_ids(next(it), 5) for _ in range(3)), [])
    assert sorted(epoch0) == list(range(12)) and epoch0 != list(range(12))
    assert it.state_dict()["epoch"] == 1
    epoch1 = sum((_window_ids(next(it), 5) for _ in range(3)), [])
    assert sorted(epoch1) == list(range(12)) and epoch1 != epoch0
    other_seed = BatchIterator(ds, (4,), seed=1, shuffle=True, random_offset=False)
    assert sum((_window_ids(next(other_seed), 5) for _ in range(3)), []) != epoch0


def test_batch_spanning_an_epoch_boundary_takes_the_rest_from_the_next_epoch():
    ds = _dataset(10)
    it = BatchIterator(ds, (4,), seed=3, shuffle=True, random_offset=False)
    stream = sum((_window_ids(next(it), 5) for _ in range(5)), [])  # 20 windows = exactly 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] == np.random.default_rng([3, 0]).permutation(10).tolist()
    assert stream[10:] == np.random.default_rng([3, 1]).permutation(10).tolist()
    assert it.state_dict() == {"epoch": 2, "position": 0, "num_windows": 10}


def test_later_epochs_move_the_window_boundaries_so_every_token_pair_is_trained():
    """Epoch 0 cuts at multiples of the window; later epochs at a random offset, so the pair
    (last token of a window, first of the next) becomes a training pair in some epoch."""
    window, n = 5, 6
    ds = WindowDataset(np.arange(n * window + 3, dtype=np.uint32), window)  # 3 leftover tokens
    assert ds.max_offset == 3
    it = BatchIterator(ds, (2,), seed=0, shuffle=True)
    pairs, offsets = set(), set()
    for _ in range(60):
        batch = next(it)
        assert (np.diff(batch, axis=-1) == 1).all() and batch.max() < n * window + 3  # whole, in-bounds rows
        offsets.update((batch[:, 0] % window).tolist())
        pairs.update((int(a), int(b)) for row in batch for a, b in zip(row[:-1], row[1:]))
    assert 0 in offsets and len(offsets) > 2
    assert pairs == {(t, t + 1) for t in range(n * window + 2)}
    first_epoch = sum((_window_ids(b, window) for b in [next(BatchIterator(ds, (6,), seed=0, shuffle=True))]), [])
    assert sorted(first_epoch) == list(range(n))  # epoch 0 is offset 0 and whole


def test_aligned_windows_keep_their_boundaries_and_every_window_in_every_epoch():
    """Packed bins (chat): later epochs reorder the bins but never shift or drop one."""
    window, n = 5, 6
    for leftover in (0, 3):  # no room to shift, and room for a shift: aligned either way
        ds = WindowDataset(np.arange(n * window + leftover, dtype=np.uint32), window, aligned=True)
        it = BatchIterator(ds, (3,), seed=0, shuffle=True)
        for epoch in range(4):
            rows = np.concatenate([next(it) for _ in range(n // 3)])
            assert (rows[:, 0] % window == 0).all(), f"epoch {epoch}: rows start off a bin boundary"
            assert sorted(_window_ids(rows, window)) == list(range(n)), f"epoch {epoch}: not every bin once"
        assert it.state_dict() == {"epoch": 4, "position": 0, "num_windows": n}


@pytest.mark.parametrize("steps_before_save", [0, 5, 13])
def test_resume_across_offset_epochs_gives_identical_next_batches(steps_before_save):
    ds = WindowDataset(np.arange(7 * 5, dtype=np.uint32), 5)  # no leftover: offset epochs lose a window
    original = BatchIterator(ds, (3,), seed=1, shuffle=True)
    for _ in range(steps_before_save):
        next(original)
    resumed = BatchIterator(ds, (3,), seed=1, shuffle=True)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for _ in range(8):
        np.testing.assert_array_equal(next(resumed), next(original))


def test_masked_rows_carry_the_loss_mask_and_document_segments():
    eot = 0
    tokens = np.array([5, 6, eot, 7, 8, 9, eot, 3, 4, eot, 1, 2], np.uint16)
    mask = np.array([0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1], np.uint8)
    ds = WindowDataset(tokens, 6, loss_mask=mask, eot_id=eot, document_mask=True)
    row = ds.get(np.array([0, 1]))
    np.testing.assert_array_equal(row["tokens"], tokens.reshape(2, 6))
    # inputs [5 6 eot 7 8] -> segments 0 0 0 1 1; [eot 3 4 eot 1] -> 0 1 1 1 2
    np.testing.assert_array_equal(row["segment_ids"], [[0, 0, 0, 1, 1], [0, 1, 1, 1, 2]])
    # the targets' mask, zeroed where the input is an eot (its target starts the next document)
    np.testing.assert_array_equal(row["loss_mask"], [[1, 1, 0, 1, 1], [0, 0, 1, 0, 1]])
    plain = WindowDataset(tokens, 6, eot_id=eot, document_mask=True).get(np.array([[1]]))
    assert plain["tokens"].shape == (1, 1, 6) and plain["loss_mask"].tolist() == [[[0, 1, 1, 0, 1]]]
    batches = BatchIterator(ds, (2, 1), seed=0, shuffle=True)
    assert {k: v.shape for k, v in next(batches).items()} == {"tokens": (2, 1, 6), "segment_ids": (2, 1, 5),
                                                              "loss_mask": (2, 1, 5)}


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


def test_the_loader_allocates_a_batch_per_step_not_the_stream():
    """The training loop calls next() every step: it must gather the batch's windows, never copy the
    token stream (4 MB here) or rebuild the epoch's window order per batch. Counted in bytes, not
    seconds (timings belong in bench/loader_speed.py): 200 batches may hold a few batches at once."""
    import tracemalloc

    ds = WindowDataset(np.zeros(2_000_000, np.uint16), 257)
    it = BatchIterator(ds, (16,), seed=0, shuffle=True)
    batch = next(it)  # the epoch's order is drawn here, once
    tracemalloc.start()
    try:
        for _ in range(200):
            assert next(it).shape == batch.shape
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * batch.nbytes, (peak, batch.nbytes)  # the stream is 250x a batch


def test_eval_batches_cover_each_selected_window_once_padding_with_weight_zero():
    ds = _dataset(11)
    batches = list(eval_batches(ds, 4, max_batches=5, seed=0))
    assert [b.shape for b, _ in batches] == [(4, 5)] * 3  # 11 windows: 4 + 4 + 3 real, 1 padding row
    weights = np.concatenate([w for _, w in batches])
    assert weights.dtype == np.float32 and weights.tolist() == [1.0] * 11 + [0.0]
    ids = sum((_window_ids(b, 5) for b, _ in batches), [])
    assert sorted(ids[:11]) == list(range(11))
    assert eval_indices(11, 1000).tolist() == list(range(11))
    # Fewer than the split: a seeded subset, a prefix of the same permutation as max_batches grows.
    small, large = eval_indices(100, 8), eval_indices(100, 16)
    assert len(small) == 8 and set(small) < set(large) and small.tolist() != list(range(8))
    assert small.tolist() == eval_indices(100, 8).tolist()


@pytest.mark.parametrize("process_count", [2, 4])
def test_eval_batch_process_slices_concatenate_to_the_global_batch(process_count):
    ds = _dataset(13)
    whole = list(eval_batches(ds, 8, max_batches=3, seed=0))
    parts = [list(eval_batches(ds, 8, 3, 0, i, process_count)) for i in range(process_count)]
    for b, (tokens, weights) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[b][0] for p in parts]), tokens)
        np.testing.assert_array_equal(np.concatenate([p[b][1] for p in parts]), weights)
    with pytest.raises(ConfigError, match="dataset.batch_size"):
        next(eval_batches(ds, 6, 1, 0, 0, 4))


# --- init_data: the caches of a run, keyed without reading the corpus ---------------------------------


def _word_corpus(root, num_docs=40):
    """Documents of a few made-up words each, so BPEs trained on different samples learn different merges."""
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    root.mkdir()
    for i in range(num_docs):
        words = ["".join(rng.choice(letters, 4)) for _ in range(3)]
        (root / f"doc{i:02d}.txt").write_text(" ".join(words * 20) + "\n")
    lines = [json.dumps({"text": f"record {i}: " + "".join(rng.choice(letters, 30))}) for i in range(10)]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    return [str(root / "*.txt"), str(root / "*.jsonl")]


def _corpus_run(tiny_run, paths, cache, *overrides):
    return tiny_run("dataset=text_files", f"dataset.paths=[{','.join(paths)}]", "dataset.val_fraction=0.2",
                    f"cache_dir={cache}", *overrides)


BPE_300 = ("tokenizer=bpe", "tokenizer.vocab_size=300")


def _build_data(run):
    """What build_trainer does for the data, short of the model."""
    import train_jax

    docs = run.dataset.source.documents()
    tok = train_jax.init_tokenizer(run, docs[0])
    return tok, train_jax.init_data(run, tok, docs)


def _streams(data) -> dict[str, np.ndarray]:
    train = getattr(data.train, "inner", data.train)  # behind the prefetch thread
    return {"train": np.asarray(train.dataset.windows_NxW).reshape(-1),
            "val": np.asarray(data.val.windows_NxW).reshape(-1)}


def _assert_fresh(run, tok, data):
    """Every token a run trains and evaluates on is what `tok` makes of the corpus as it is now."""
    fresh_docs = dict(zip(("train", "val"), run.dataset.source.documents()))  # new Documents: read the files now
    for split, stream in _streams(data).items():
        fresh = tokenize_documents(fresh_docs[split], tok)
        np.testing.assert_array_equal(stream, fresh[: stream.size], err_msg=f"{split}: stale token cache")


def test_bpes_trained_on_different_samples_get_their_own_token_caches(tmp_path, tiny_run):
    paths, cache = _word_corpus(tmp_path / "corpus"), tmp_path / "cache"
    runs = [_corpus_run(tiny_run, paths, cache, *BPE_300, f"tokenizer.sample_docs={n}") for n in (3, 1000)]
    built = [_build_data(run) for run in runs]
    for run, (tok, data) in zip(runs, built):
        _assert_fresh(run, tok, data)  # before: the second run read the first BPE's ids (same name bpe-300)
    (tok_a, _), (tok_b, _) = built
    assert tok_a.name == tok_b.name and tok_a.fingerprint != tok_b.fingerprint
    assert len(list((cache / "tokens").glob("*.npy"))) == 4


def test_a_cache_hit_reads_no_documents(tmp_path, tiny_run, monkeypatch):
    paths, cache = _word_corpus(tmp_path / "corpus"), tmp_path / "cache"
    run = _corpus_run(tiny_run, paths, cache, *BPE_300, "tokenizer.sample_docs=10")
    tok, data = _build_data(run)

    def forbidden(*args, **kwargs):
        raise AssertionError("the corpus was read although every cache should hit")

    monkeypatch.setattr(corpus, "read_text", forbidden)
    monkeypatch.setattr(text_files, "_jsonl_documents", forbidden)
    monkeypatch.setattr(bpe, "_train_bpe", forbidden)
    again_tok, again = _build_data(run)
    assert again_tok.fingerprint == tok.fingerprint
    for split, stream in _streams(data).items():
        np.testing.assert_array_equal(_streams(again)[split], stream)


def test_touching_or_editing_a_corpus_file_invalidates_the_token_cache(tmp_path, tiny_run, monkeypatch):
    paths, cache = _word_corpus(tmp_path / "corpus"), tmp_path / "cache"
    run = _corpus_run(tiny_run, paths, cache)  # byte tokenizer: only the token cache is in play
    _, data = _build_data(run)
    before = set((cache / "tokens").glob("*.npy"))
    assert len(before) == 2

    reads = []
    read_text = corpus.read_text
    monkeypatch.setattr(corpus, "read_text", lambda path: reads.append(path) or read_text(path))
    doc = tmp_path / "corpus" / "doc07.txt"
    st = doc.stat()
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # touch: same bytes, newer mtime
    tok, touched = _build_data(run)
    assert reads, "a touched corpus must be re-read"
    assert len(set((cache / "tokens").glob("*.npy")) - before) == 2  # both splits: membership may have moved
    _assert_fresh(run, tok, touched)

    doc.write_text("an edited document, nothing like the others\n" * 5)
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 4_000_000_000))  # even on a coarse-mtime filesystem
    tok, edited = _build_data(run)
    _assert_fresh(run, tok, edited)
    both = [np.concatenate(list(_streams(d).values())) for d in (touched, edited)]
    assert both[0].size != both[1].size or (both[0] != both[1]).any()


def test_bpe_trains_on_a_seeded_random_sample_of_the_train_split(tmp_path, tiny_run, monkeypatch):
    import train_jax

    paths = _word_corpus(tmp_path / "corpus")
    samples = []
    train_bpe = bpe._train_bpe

    def recording(vocab_size, texts):
        samples.append(list(texts))
        return train_bpe(vocab_size, samples[-1])

    monkeypatch.setattr(bpe, "_train_bpe", recording)
    for cache in ("c1", "c2"):  # two fresh caches: the tokenizer is trained twice
        run = _corpus_run(tiny_run, paths, tmp_path / cache, *BPE_300, "tokenizer.sample_docs=5")
        train_jax.init_tokenizer(run, run.dataset.source.documents()[0])
    train_docs = list(run.dataset.source.documents()[0])
    first, second = samples
    assert len(first) == 5 and first == second  # deterministic across runs
    assert first != train_docs[:5]  # not the first files in path order
    assert first == [d for d in train_docs if d in first]  # a subset, in corpus order
    assert corpus.sample_documents(train_docs, 5, seed=1) != first  # the seed, not the corpus, picks it
    assert corpus.sample_documents(train_docs, 10_000, seed=0) == train_docs


def test_in_memory_documents_still_work_as_before(tmp_path, tiny_run):
    """Callers may pass plain lists (notebooks, tests): they are fingerprinted by content."""
    import train_jax

    run = _corpus_run(tiny_run, _word_corpus(tmp_path / "corpus"), tmp_path / "cache", *BPE_300)
    docs = (["alpha beta gamma " * 40, "delta epsilon " * 40], ["zeta eta " * 40])
    tok = train_jax.init_tokenizer(run, docs[0])
    val = _streams(train_jax.init_data(run, tok, docs))["val"]
    assert val.tolist() == tokenize_documents(docs[1], tok)[: val.size].tolist()
    other = _streams(train_jax.init_data(run, tok, (docs[0], ["theta iota " * 40])))["val"]
    assert other.tolist() != val.tolist()
