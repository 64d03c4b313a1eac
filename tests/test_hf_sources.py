"""dataset=hf and dataset=jsonl: offline, on small local files, calling the sources directly.

Local json/csv/parquet files go through `datasets.load_dataset`'s own builders, which is the code
path a hub dataset takes once downloaded; the hub itself is only checked to fail fast offline.
"""

import os

# Before anything imports huggingface_hub, which reads these once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"

import json
import time

import numpy as np
import pytest

from loaders import dataset_config, records
from loaders.config import DataRequest
from loaders.pipeline import source_windows
from loaders.sources import HF, Jsonl
from loaders.tokenizers import byte_tokenizer
from loaders.windows import batch_tokens
from utils.errors import CheckpointError, ConfigError, DataError

TOK = byte_tokenizer()
WINDOW = 17


def story(i: int) -> str:
    """Texts of different lengths, so windows start mid-document and span documents."""
    return f"story {i}: " + "la " * (i % 7) + "end"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Each test's Arrow cache in its tmp_path; the hub unreachable even if imported before the env was set."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def warnings(monkeypatch):
    said = []
    monkeypatch.setattr(records, "warn", said.append)
    return said


def build(node: dict):
    """A dataset section as the config boundary builds it (knob types checked, check() run)."""
    return dataset_config(node).source


def request(tmp_path, document_mask=False) -> DataRequest:
    return DataRequest(TOK, str(tmp_path / "cache"), WINDOW, document_mask)


def split_texts(source) -> tuple[list[str], list[str]]:
    train, val = source.documents()
    return list(train), list(val)


# --- jsonl ----------------------------------------------------------------------------------------


def test_jsonl_documents_are_the_records_single_and_list_fields(tmp_path):
    rows = [{"text": story(i), "q": f"question {i}", "a": f"answer {i}" if i % 3 else None, "n": i}
            for i in range(40)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "   ")  # blank lines are not records
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("\n".join(lines[:20]) + "\n")
    empty = json.dumps({"text": "", "q": "", "a": None})  # no text: not a document, and not a bad record
    (tmp_path / "d" / "b.jsonl").write_text("\n".join(lines[20:] + [empty]) + "\n")
    pattern = str(tmp_path / "d" / "*.jsonl")

    source = build({"name": "jsonl", "paths": pattern, "val_fraction": 0.3})  # a bare glob is a list of one
    train, val = split_texts(source)
    assert sorted(train + val) == sorted(story(i) for i in range(40))  # the empty one is no document
    assert train and val and not set(train) & set(val)
    assert (train, val) == split_texts(source)  # stable

    joined = build({"name": "jsonl", "paths": [pattern], "text_field": ["q", "a"], "val_fraction": 0.3})
    train, val = split_texts(joined)
    want = {f"question {i}\n\nanswer {i}" if i % 3 else f"question {i}" for i in range(40)}  # None is left out
    assert set(train + val) == want and len(train + val) == 40
    # The split key is relative path:line, whatever the text field: the same lines are held out.
    held = {int(t.split()[1]) for t in val}
    assert held == {int(t.split(":")[0].split()[1]) for t in split_texts(source)[1]}


def test_jsonl_bad_lines_name_file_and_line_or_are_skipped_and_counted(tmp_path, warnings):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": story(i)} for i in range(30)])
    with open(path, "a") as f:
        f.write('{"text": oops}\n{"body": "no text field", "id": 3}\n[1, 2]\n')

    with pytest.raises(DataError) as e:
        split_texts(build({"name": "jsonl", "paths": [path]}))
    assert f"{path}:31 is not valid JSON" in str(e.value) and "dataset.skip_bad_records=true" in str(e.value)
    assert "\n" not in str(e.value)

    without_bad_json = tmp_path / "b.jsonl"
    good_lines = (tmp_path / "a.jsonl").read_text().splitlines()[:30]
    without_bad_json.write_text("\n".join(good_lines + ['{"body": "x", "id": 3}']) + "\n")
    with pytest.raises(DataError) as e:
        split_texts(build({"name": "jsonl", "paths": [str(without_bad_json)]}))
    message = str(e.value)
    assert f"{without_bad_json}:31" in message and "'text'" in message and "['body', 'id']" in message
    assert "dataset.text_field" in message and "skip_bad_records" in message

    train, val = split_texts(build({"name": "jsonl", "paths": [path], "skip_bad_records": True}))
    assert sorted(train + val) == sorted(story(i) for i in range(30))
    assert len(warnings) == 1 and "skipped 3 of 33 records" in warnings[0] and f"{path}:31" in warnings[0]


def test_jsonl_missing_and_empty_files_and_mistyped_list_field(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        build({"name": "jsonl", "paths": [str(tmp_path / "nope" / "*.jsonl")]}).documents()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        split_texts(build({"name": "jsonl", "paths": [str(tmp_path / "empty.jsonl")]}))
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "a", "a": "b"}] * 5)
    with pytest.raises(DataError, match="entry 'answer' is in no record"):
        split_texts(build({"name": "jsonl", "paths": [path], "text_field": ["q", "answer"]}))


def test_knobs_are_checked_at_the_boundary(tmp_path):
    source = build({"name": "hf", "path": "json", "data_files": "data/*.jsonl", "text_field": ["a", "b"]})
    assert source.data_files == ("data/*.jsonl",) and source.fields == ("a", "b")
    hash(source)  # lists are stored as tuples: the config stays hashable
    for node, knob in [({"text_field": 5}, "dataset.text_field"), ({"text_field": []}, "dataset.text_field"),
                       ({"path": "data/x.jsonl", "data_files": None}, "dataset.path"),
                       ({"data_files": None}, "dataset.path=json reads local files"),
                       ({"val_split": "validation"}, "dataset.val_split"),
                       ({"val_fraction": 0.0}, "dataset.val_fraction"),
                       ({"shuffle_buffer": -1}, "dataset.shuffle_buffer"),
                       ({"max_val_documents": 0}, "dataset.max_val_documents"),
                       ({"name_of_config": "x"}, "unknown knob dataset.name_of_config")]:
        with pytest.raises(ConfigError, match=knob.replace(".", r"\.")):
            build({"name": "hf", "path": "json", "data_files": ["x.jsonl"], **node})
    with pytest.raises(ConfigError, match=r"dataset\.paths"):
        build({"name": "jsonl", "paths": []})


def test_shuffle_false_on_a_shuffled_stream_is_refused_naming_the_knob_that_orders_it(tiny_run):
    """A stream is shuffled by its buffer, not by dataset.shuffle: shuffle=false alone would be
    silently ignored, so it stops before anything is read; with shuffle_buffer=0 it is the stream's order."""
    stream = ("dataset=hf", "dataset.path=json", "dataset.data_files=data/*.jsonl", "dataset.streaming=true")
    with pytest.raises(ConfigError, match=r"dataset\.shuffle=false .* set dataset\.shuffle_buffer=0"):
        tiny_run(*stream, "dataset.shuffle=false")
    assert tiny_run(*stream, "dataset.shuffle=false", "dataset.shuffle_buffer=0").dataset.source.shuffle_buffer == 0
    assert not tiny_run("dataset=hf", "dataset.path=json", "dataset.data_files=data/*.jsonl",
                        "dataset.shuffle=false").dataset.shuffle  # not streaming: shuffle=false orders the windows


def test_yamls_compose_into_the_sources(tiny_run):
    run = tiny_run("dataset=hf", "dataset.path=json", "dataset.data_files=data/*.jsonl", "dataset.text_field=body")
    assert isinstance(run.dataset.source, HF) and run.dataset.source.fields == ("body",)
    run = tiny_run("dataset=jsonl", "dataset.paths=[data/*.jsonl]", "dataset.text_field=[instruction,input,output]")
    assert isinstance(run.dataset.source, Jsonl) and run.dataset.source.text_field == ("instruction", "input", "output")


# --- hf, not streaming ----------------------------------------------------------------------------


def test_hf_local_json_csv_parquet_give_the_same_documents(tmp_path):
    import pandas as pd

    texts = [story(i) for i in range(50)]
    frame = pd.DataFrame({"text": texts, "id": range(50)})
    write_jsonl(tmp_path / "d.jsonl", frame.to_dict("records"))
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    got = {}
    for builder, ext in [("json", "jsonl"), ("csv", "csv"), ("parquet", "parquet")]:
        source = build({"name": "hf", "path": builder, "data_files": [str(tmp_path / f"d.{ext}")],
                        "val_fraction": 0.2})
        got[builder] = split_texts(source)
        train, val = got[builder]
        assert train + val != texts and sorted(train + val) == sorted(texts) and train and val
        assert train == [t for t in texts if t in set(train)]  # record order is kept
    assert got["json"] == got["csv"] == got["parquet"]  # held out by content: the same records whatever the format


def test_hf_list_text_field_and_bad_records(tmp_path, warnings):
    import pandas as pd

    qs = [None if i in (7, 9, 13) else f"q{i}" for i in range(20)]
    answers = [None if i % 4 == 0 or i in (9, 13) else f"a{i}" for i in range(20)]
    pd.DataFrame({"q": qs, "a": answers, "n": list(range(20))}).to_parquet(tmp_path / "d.parquet")
    node = {"name": "hf", "path": "parquet", "data_files": [str(tmp_path / "d.parquet")], "val_fraction": 0.2}

    with pytest.raises(DataError, match=r"record 9 has none of the fields \['q', 'a'\] .*keys: \['a', 'n', 'q'\]"):
        split_texts(build({**node, "text_field": ["q", "a"]}))
    train, val = split_texts(build({**node, "text_field": ["q", "a"], "skip_bad_records": True}))
    want = {"\n\n".join(x for x in (q, a) if x) for q, a in zip(qs, answers) if q or a}
    assert set(train + val) == want and len(train + val) == 18  # one None of two is left out, two of two is bad
    assert warnings == [warnings[0]] and "skipped 2 of 20 records" in warnings[0]

    with pytest.raises(DataError) as e:  # a single field that is None (a missing value)
        split_texts(build({**node, "text_field": "a"}))
    assert "record 0 has field 'a' null" in str(e.value) and "['a', 'n', 'q']" in str(e.value)
    train, val = split_texts(build({**node, "text_field": "a", "skip_bad_records": True}))
    assert sorted(train + val) == sorted(a for a in answers if a)
    assert len(warnings) == 2 and "skipped 7 of 20 records" in warnings[1]

    with pytest.raises(DataError, match=r"no column 'body' \(its columns: \['a', 'n', 'q'\]\)"):
        split_texts(build({**node, "text_field": "body"}))
    with pytest.raises(DataError, match="column 'n' .* holds .*int64.*, not text"):
        split_texts(build({**node, "text_field": ["q", "n"]}))


def test_hf_val_split_and_held_out_fraction(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    write_jsonl(root / "train.jsonl", [{"text": story(i)} for i in range(60)])
    write_jsonl(root / "validation.jsonl", [{"text": f"val {i}"} for i in range(8)])

    named = build({"name": "hf", "path": str(root), "val_split": "validation"})
    train, val = split_texts(named)
    assert train == [story(i) for i in range(60)] and val == [f"val {i}" for i in range(8)]

    held = build({"name": "hf", "path": str(root), "val_fraction": 0.25})
    h_train, h_val = split_texts(held)
    assert h_val and not set(h_train) & set(h_val) and sorted(h_train + h_val) == sorted(train)
    assert (h_train, h_val) == split_texts(held)  # stable across calls
    assert len({d.fingerprint for d in (*named.documents(), *held.documents())}) == 4  # caches never mix them

    with pytest.raises(ConfigError, match=r"dataset\.split='nope' does not exist"):
        split_texts(build({"name": "hf", "path": str(root), "split": "nope"}))
    with pytest.raises(ConfigError, match=r"dataset\.val_split='test' does not exist"):
        split_texts(build({"name": "hf", "path": str(root), "val_split": "test"}))


def test_hf_fingerprint_follows_the_files_without_reading_them(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": story(i)} for i in range(30)])
    source = build({"name": "hf", "path": "json", "data_files": [path]})
    before = [d.fingerprint for d in source.documents()]
    assert before == [d.fingerprint for d in source.documents()]
    write_jsonl(tmp_path / "d.jsonl", [{"text": story(i)} for i in range(31)])
    assert [d.fingerprint for d in source.documents()] != before
    train_ds, val_ds = source_windows(source, request(tmp_path))  # the pipeline's cached windows
    assert train_ds.window == WINDOW and len(train_ds) and len(val_ds)


def test_hf_bad_inputs_are_one_line_data_errors(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        build({"name": "hf", "path": "json", "data_files": [str(tmp_path / "no" / "*.jsonl")]}).documents()
    (tmp_path / "empty.jsonl").write_text("")
    for streaming in (False, True):
        with pytest.raises(DataError, match="holds no records|has no records|no validation documents") as e:
            source = build({"name": "hf", "path": "json", "data_files": [str(tmp_path / "empty.jsonl")],
                            "streaming": streaming})
            source.windows(request(tmp_path)) if streaming else split_texts(source)
        assert "\n" not in str(e.value)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    with pytest.raises(DataError, match="cannot be loaded .*ArrowInvalid: JSON parse error.*dataset=jsonl names"):
        split_texts(build({"name": "hf", "path": "json", "data_files": [str(tmp_path / "bad.jsonl")]}))


def test_hub_dataset_offline_fails_fast_with_one_line(tmp_path):
    for streaming in (False, True):
        start = time.monotonic()
        with pytest.raises(DataError) as e:
            source = build({"name": "hf", "path": "eqtrain-tests/no-such-dataset", "streaming": streaming})
            source.windows(request(tmp_path)) if streaming else source.documents()
        assert time.monotonic() - start < 10
        message = str(e.value)
        assert "dataset.path='eqtrain-tests/no-such-dataset'" in message and "HF_HUB_OFFLINE=1" in message
        assert "\n" not in message


# --- hf, streaming --------------------------------------------------------------------------------


def stream_source(tmp_path, n=45, **knobs):
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": story(i), "id": i} for i in range(n)])
    node = {"name": "hf", "path": "json", "data_files": [path], "streaming": True, "shuffle_buffer": 8,
            "val_fraction": 0.2, **knobs}
    return build(node), path


def expected_tokens(path, source, seed: int, epochs: int) -> np.ndarray:
    """The stream as the brief defines it, built independently: `datasets`' own shuffle, record by
    record, held-out documents left out, each document's bytes then eot."""
    import datasets

    base = datasets.load_dataset("json", data_files=[path], split="train", streaming=True)
    out = []
    for epoch in range(epochs):
        shuffled = base.shuffle(seed=seed, buffer_size=source.shuffle_buffer)
        shuffled.set_epoch(epoch)
        for record in shuffled:
            if not source.is_val(record["text"]):
                out.extend([*record["text"].encode(), TOK.eot_id])
    return np.array(out, np.int32)


def take(it, n):
    return [batch_tokens(next(it)).copy() for _ in range(n)]


def test_stream_batches_are_windows_of_the_shuffled_token_stream(tmp_path):
    source, path = stream_source(tmp_path)
    train, val = source.windows(request(tmp_path))
    shape = (2, 3)
    batches = take(train.batches(shape, seed=5), 20)  # 20*6*17 tokens: more than two epochs
    assert all(b.shape == (2, 3, WINDOW) and b.dtype == np.int32 for b in batches)
    stream = np.concatenate([b.reshape(-1) for b in batches])
    want = expected_tokens(path, source, 5, 3)
    assert len(want) > len(stream) > len(want) // 3 * 2  # it really crossed two epoch ends
    np.testing.assert_array_equal(stream, want[: len(stream)])

    in_file_order = np.array([t for i in range(45) if not source.is_val(story(i))
                              for t in [*story(i).encode(), TOK.eot_id]], np.int32)
    first_epoch = want[: len(in_file_order)]
    assert not np.array_equal(first_epoch, in_file_order)  # shuffled...
    assert not np.array_equal(want[len(in_file_order) : 2 * len(in_file_order)], first_epoch)  # ...afresh each epoch

    np.testing.assert_array_equal(np.concatenate(take(train.batches(shape, seed=5), 20)).reshape(-1), stream)
    assert not np.array_equal(take(train.batches(shape, seed=6), 1)[0], batches[0])

    # Validation: the held-out documents, in file order (`want` above has none of them).
    held = [story(i) for i in range(45) if source.is_val(story(i))]
    assert held and val.window == WINDOW
    assert TOK.decode(val.tokens) == "".join(held)


def test_stream_resumes_exactly_mid_document_and_across_epochs(tmp_path):
    source, _ = stream_source(tmp_path)
    train, _ = source.windows(request(tmp_path))
    shape = (1, 4)
    it = train.batches(shape, seed=1)
    states, batches = [], []
    for _ in range(16):  # ~3 epochs
        states.append(json.loads(json.dumps(it.state_dict())))
        batches.append(next(it))
    assert any(s["offset"] > 0 for s in states)  # mid-document
    assert any(s["epoch"] >= 1 for s in states)  # after an epoch end
    spans = [k for k in range(15) if states[k]["epoch"] != states[k + 1]["epoch"]]
    assert spans  # a batch that started in one epoch and ended in the next
    for k in sorted({1, 2, 5, *spans, *[k + 1 for k in spans], 13}):
        resumed = train.batches(shape, seed=1)
        resumed.load_state_dict(states[k])
        assert resumed.state_dict() == states[k]
        for j in range(k, min(k + 3, 16)):
            np.testing.assert_array_equal(next(resumed), batches[j], err_msg=f"resumed at batch {k}, batch {j}")

    wrong = train.batches(shape, seed=1)
    with pytest.raises(CheckpointError, match="model.context_length"):
        wrong.load_state_dict({**states[3], "window": WINDOW + 1})
    moved = train.batches(shape, seed=2)  # another data_seed: the saved record is not where the offset points
    moved.load_state_dict(next(s for s in states if s["offset"] > 0 and s["epoch"] == 0))
    with pytest.raises(CheckpointError, match="same dataset"):
        for _ in range(3):
            next(moved)


def test_stream_process_slices_concatenate_to_the_global_batch(tmp_path):
    source, _ = stream_source(tmp_path)
    train, _ = source.windows(request(tmp_path))
    shape = (2, 4)
    whole = take(train.batches(shape, seed=3), 4)
    parts = [take(train.batches(shape, seed=3, process_index=p, process_count=2), 4) for p in range(2)]
    for k in range(4):
        assert parts[0][k].shape == (2, 2, WINDOW)
        np.testing.assert_array_equal(np.concatenate([parts[0][k], parts[1][k]], axis=-2), whole[k])


def test_stream_document_mask_and_named_val_split(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    write_jsonl(root / "train.jsonl", [{"text": story(i)} for i in range(30)])
    write_jsonl(root / "test.jsonl", [{"text": f"held {i}"} for i in range(10)])
    source = build({"name": "hf", "path": str(root), "streaming": True, "val_split": "test",
                    "max_val_documents": 4, "shuffle_buffer": 0})
    train, val = source.windows(request(tmp_path, document_mask=True))
    assert TOK.decode(val.tokens) == "held 0held 1held 2held 3" and val.document_mask
    plain = np.concatenate([b.reshape(-1) for b in take(source.windows(request(tmp_path))[0].batches((2,), 0), 3)])
    masked = [next(it) for it in [train.batches((2,), 0)] for _ in range(3)]
    assert set(masked[0]) == {"tokens", "segment_ids", "loss_mask"}
    assert masked[0]["segment_ids"].shape == (2, WINDOW - 1)
    np.testing.assert_array_equal(np.concatenate([m["tokens"].reshape(-1) for m in masked]), plain)
    # shuffle_buffer=0: the file's order; every record is trained on (validation is its own split)
    want = np.array([t for i in range(30) for t in [*story(i).encode(), TOK.eot_id]][: len(plain)], np.int32)
    np.testing.assert_array_equal(plain, want)


def test_stream_bad_records_and_no_documents_for_bpe(tmp_path, warnings):
    rows = [{"text": story(i)} for i in range(30)] + [{"text": None}] * 3
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    node = {"name": "hf", "path": "json", "data_files": [path], "streaming": True, "shuffle_buffer": 4}
    with pytest.raises(DataError, match=r"record \d+ .*has field 'text' null"):
        train, _ = build(node).windows(request(tmp_path))
        take(train.batches((4,), 0), 10)
    train, _ = build({**node, "skip_bad_records": True}).windows(request(tmp_path))
    take(train.batches((4,), 0), 10)  # past the first epoch's end
    assert any("skipped 3 of 33 records" in w for w in warnings)

    docs, _ = build(node).documents()  # nothing is read until a tokenizer that trains on text asks
    with pytest.raises(ConfigError, match="streaming=true gives no list of documents"):
        len(docs)
