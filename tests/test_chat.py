"""dataset=chat: record formats, the loss mask token by token, truncation, packing, splits, the
cache and bad input. Offline and fast: functions are called directly, no training runs."""

import os

# Before anything imports huggingface_hub, which reads these once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json

import numpy as np
import pytest

from loaders import chat, corpus, dataset_config, tokenizers
from loaders.config import DataRequest
from loaders.sources import SOURCES
from loaders.sources import chat as chat_source
from loaders.sources.chat import Chat, pack
from loaders.tokenizers import bpe
from loaders.windows import WindowDataset, segment_ids
from utils.errors import ConfigError, DataError

CONVERSATION = [("system", "be brief"), ("user", "hi there"), ("assistant", "hello!"),
                ("user", "what is 2+2?"), ("assistant", "4, naïvely")]
# Each turn on its own line, closed by <|im_end|>; the generation prompt is the assistant header.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """load_dataset's arrow cache in the test's tmp_path, not ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture
def warnings_seen(monkeypatch):
    seen = []
    monkeypatch.setattr(chat_source, "warn", seen.append)
    return seen


@pytest.fixture(scope="module")
def hf_backend():
    sample = ["<|im_start|>user\nhi there<|im_end|>\n" * 20, "the quick brown fox jumps " * 40, "naïve 2+2=4 " * 30]
    return bpe._train_bpe(320, sample)


def hf_tok(tmp_path, backend, template=CHATML):
    """A Hugging Face tokenizer with `template` as its chat_template, saved and loaded offline."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizers.EOT_TOKEN)
    fast.chat_template = template
    path = tmp_path / f"tok-{abs(hash(template))}"
    fast.save_pretrained(path)
    return tokenizers.hf_tokenizer(str(path))


def runs(ids_N, mask_N):
    """The maximal runs of mask-1 tokens, as id lists."""
    out, cur = [], []
    for i, m in zip(ids_N.tolist(), mask_N.tolist()):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def req(tok, cache, window=64, document_mask=True):
    return DataRequest(tokenizer=tok, cache_dir=str(cache), window=window, document_mask=document_mask)


# --- formats and rendering ------------------------------------------------------------------------


def as_record(fmt, turns):
    if fmt == "messages":
        return {"messages": [{"role": r, "content": c} for r, c in turns], "prompt": None}
    if fmt == "conversations":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[r], "value": c} for r, c in turns], "messages": None}
    assert [r for r, _ in turns] == ["user", "assistant"]
    return {"prompt": turns[0][1], "response": turns[1][1], "messages": None}


@pytest.mark.parametrize("fmt", ["messages", "conversations", "prompt_response"])
def test_plain_template_masks_exactly_the_assistant_content_byte_by_byte(fmt):
    turns = CONVERSATION if fmt != "prompt_response" else [("user", "hi there"), ("assistant", "hello!")]
    assert chat.to_turns(as_record(fmt, turns)) == turns
    tok = tokenizers.byte_tokenizer()
    ids, mask = chat.render(chat.to_turns(as_record(fmt, turns)), tok)

    expected_ids, expected_mask = [], []
    for role, content in turns:
        header, body = f"<|{role}|>\n".encode(), f"{content}\n".encode()
        expected_ids += list(header) + list(body)
        expected_mask += [0] * len(header) + [int(role == "assistant")] * len(body)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8
    assert ids.tolist() == expected_ids + [tok.eot_id]
    assert mask.tolist() == expected_mask + [1]  # the eot closing the assistant's last turn is trained on
    assert tok.decode(ids[mask == 1]) == "".join(c + "\n" for r, c in turns if r == "assistant")


def test_plain_template_pieces_tokenize_like_the_whole_text_with_a_bpe(hf_backend):
    tok = tokenizers.BPETokenizer(hf_backend, "bpe-test")
    ids, mask = chat.render(CONVERSATION, tok)
    assert ids.tolist() == tok.encode(chat.plain_text(CONVERSATION)).tolist() + [tok.eot_id]
    assert tok.decode(ids[mask == 1]) == "hello!\n4, naïvely\n" and mask[-1] == 1


def test_conversation_ending_with_a_user_turn_does_not_train_its_eot():
    ids, mask = chat.render([("user", "q"), ("assistant", "a"), ("user", "and?")], tokenizers.byte_tokenizer())
    assert ids[-1] == 256 and mask[-1] == 0 and tokenizers.byte_tokenizer().decode(ids[mask == 1]) == "a\n"


def test_chat_template_masks_assistant_turns_without_their_headers(tmp_path, hf_backend):
    tok = hf_tok(tmp_path, hf_backend)
    assert chat.uses_tokenizer_template(tok) and not chat.uses_tokenizer_template(tok, "plain")
    ids, mask = chat.render(CONVERSATION, tok)
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    whole = tok._tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == whole  # pieces tokenized apart still spell the template's text
    assert ids[-1] == tok.eot_id and mask[-1] == 1
    bodies = [tok.decode(run) for run in runs(ids, mask)]
    # Headers (<|im_start|>assistant\n: the generation prompt) are given at inference: mask 0.
    assert bodies == ["hello!<|im_end|>\n", "4, naïvely<|im_end|>\n"]
    assert "system" in tok.decode(ids[mask == 0]) and "be brief" in tok.decode(ids[mask == 0])


def test_template_without_generation_prompt_trains_on_the_whole_assistant_turn(tmp_path, hf_backend):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = hf_tok(tmp_path, hf_backend, template)
    ids, mask = chat.render([("user", "hi"), ("assistant", "yo")], tok)
    assert [tok.decode(r) for r in runs(ids, mask)] == ["[assistant] yo\n"]


def test_template_that_ends_turns_with_eos_is_not_closed_twice(tmp_path, hf_backend):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok = hf_tok(tmp_path, hf_backend, template)
    ids, mask = chat.render([("user", "hi"), ("assistant", "yo")], tok)
    assert (ids == tok.eot_id).sum() == 2 and ids[-1] == tok.eot_id and ids[-2] != tok.eot_id and mask[-1] == 1


def test_template_that_rewrites_earlier_turns_is_refused_and_plain_is_the_way_out(tmp_path, hf_backend):
    template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    tok = hf_tok(tmp_path, hf_backend, template)
    with pytest.raises(DataError, match="dataset.template=plain") as info:
        chat.render([("user", "hi"), ("assistant", "yo")], tok)
    assert "\n" not in str(info.value)
    ids, mask = chat.render([("user", "hi"), ("assistant", "yo")], tok, template="plain")
    assert tok.decode(ids) == "<|user|>\nhi\n<|assistant|>\nyo\n" and tok.decode(ids[mask == 1]) == "yo\n"


def test_a_template_that_raises_is_a_bad_record(tmp_path, hf_backend):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    with pytest.raises(chat.BadRecord, match="no system role.*skip_bad_records"):
        chat.render(CONVERSATION, hf_tok(tmp_path, hf_backend, template))


@pytest.mark.parametrize("record, match", [
    ({"text": "hello", "id": 3}, r"matches no chat format \(its keys: \['id', 'text'\]\).*messages"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user"}]}, "lacks a string 'role' or 'content'"),
    ({"conversations": [{"from": "bing", "value": "x"}]}, "ShareGPT role from='bing'"),
    ({"prompt": "only a prompt"}, "matches no chat format"),
])
def test_malformed_records_are_bad_records_naming_the_problem(record, match):
    with pytest.raises(chat.BadRecord, match=match) as info:
        chat.to_turns(record, "data/x.jsonl record 7")
    assert str(info.value).startswith("data/x.jsonl record 7") and "\n" not in str(info.value)


# --- packing and windows --------------------------------------------------------------------------


def test_pack_keeps_every_conversation_inside_one_window_and_pads_with_unmasked_eot():
    rng = np.random.default_rng(0)
    window, eot = 16, 99
    convs = [(np.full(n, i, np.int32), np.ones(n, np.uint8)) for i, n in enumerate(rng.integers(1, window + 1, 40))]
    tokens, mask, starts = pack(convs, window, eot, np.dtype(np.uint16))
    assert tokens.dtype == np.uint16 and len(tokens) % window == 0 and mask.shape == tokens.shape == starts.shape
    # a start at each conversation's first token and at each bin's padding, nowhere else
    is_pad = tokens == eot
    first_of_run = np.r_[True, tokens[1:] != tokens[:-1]] | (np.arange(len(tokens)) % window == 0)
    np.testing.assert_array_equal(starts.astype(bool),
                                  first_of_run & ~(is_pad & (np.arange(len(tokens)) % window == 0)))
    bins_NxW = tokens.reshape(-1, window)
    seen = []
    for b, row in enumerate(bins_NxW):
        for i in np.unique(row[row != eot]):
            where = np.flatnonzero(row == i)
            assert len(where) == len(convs[i][0]) and np.all(np.diff(where) == 1)  # whole and contiguous
            seen.append((b, int(i)))
    assert [i for _, i in seen] == list(range(len(convs)))  # each once, in order
    assert np.all(mask[tokens == eot] == 0) and np.all(mask[tokens != eot] == 1)
    # Next-fit: a bin was closed only because the next conversation did not fit its rest.
    for b in range(len(bins_NxW) - 1):
        used = int((bins_NxW[b] != eot).sum())
        first_next = int(bins_NxW[b + 1][0])
        assert used + len(convs[first_next][0]) > window


def test_window_rows_carry_the_mask_and_one_segment_per_conversation(tmp_path):
    records = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(6)]
    src = Chat(path="json", data_files=(write_jsonl(tmp_path / "c.jsonl", records),), val_fraction=0.3)
    tok = tokenizers.byte_tokenizer()
    train, val = src.windows(req(tok, tmp_path / "cache", window=64))
    assert isinstance(train, WindowDataset) and train.max_offset == 0 and train.document_mask
    row = train.get(np.array([0]))
    tokens_W, loss_T, seg_T = row["tokens"][0], row["loss_mask"][0], row["segment_ids"][0]
    text = tok.decode(tokens_W)
    assert text.startswith("<|user|>\nq") and "<|assistant|>\na" in text
    # With the plain template the eots are exactly the conversation ends: before the padding, the
    # packing's starts and the eots give the same segments (the padding is one segment, not one per eot).
    real = int(np.flatnonzero(loss_T)[-1]) + 1
    assert np.array_equal(seg_T[:real], segment_ids(tokens_W[None, :-1], tok.eot_id)[0][:real])
    assert len(set(seg_T[real + 1:].tolist())) <= 1
    n_conv = text.count("<|user|>")
    starts = [i for i in range(len(tokens_W) - 1) if tok.decode(tokens_W[i : i + 8]) == "<|user|>"]
    assert n_conv >= 2 and [int(seg_T[i]) for i in starts] == list(range(n_conv))  # one segment per conversation
    # Trained targets: each answer "a<i>\n" and the eot that closes it, nothing of prompts or pads.
    targets = tokens_W[1:][loss_T == 1]
    assert tok.decode(targets) == "".join(f"a{i}\n" for i in range(6) if f"q{i}" in text)
    assert (targets == tok.eot_id).sum() == n_conv and not np.any(loss_T[tokens_W[:-1] == tok.eot_id])
    assert train.stats.conversations + val.stats.conversations == 6 and train.stats.truncated == 0
    assert set(train.stats.metrics()) >= {"data/truncated", "data/conversations", "data/skipped_records"}


def test_long_conversations_are_truncated_counted_and_reported(tmp_path, warnings_seen):
    records = [{"prompt": "q", "response": "x" * 100}] * 3 + [{"prompt": "q", "response": "ok"}] * 37
    src = Chat(path="json", data_files=(write_jsonl(tmp_path / "c.jsonl", records),), val_fraction=0.2)
    train, val = src.windows(req(tokenizers.byte_tokenizer(), tmp_path / "cache", window=33))
    assert train.stats.truncated + val.stats.truncated == 3
    assert train.stats.conversations + val.stats.conversations == 40
    (message,) = [w for w in warnings_seen if "truncated" in w]
    assert "3 of 40 conversations (7.5%)" in message and "context_length+1=33" in message
    assert "model.context_length" in message
    assert train.info == train.stats.metrics() and train.info["data/truncated"] == train.stats.truncated
    # A truncated conversation fills its window alone, with no eot (it did not end).
    rows = np.concatenate([ds.tokens.reshape(-1, 33) for ds in (train, val)])
    assert sum(bool(np.all(r[-8:] == ord("x"))) for r in rows) == 3


def test_val_split_is_disjoint_from_train_and_stable(tmp_path):
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(60)]
    files = (write_jsonl(tmp_path / "c.jsonl", records),)
    tok = tokenizers.byte_tokenizer()
    train, val = Chat(path="json", data_files=files, val_fraction=0.25).windows(req(tok, tmp_path / "cache", 128))

    def questions(ds):
        return {int(line.split()[1]) for line in tok.decode(ds.tokens).splitlines() if line.startswith("question")}

    assert not questions(train) & questions(val) and questions(train) | questions(val) == set(range(60))
    assert questions(val) == {i for i in range(60) if corpus.is_val(str(i), 0.25)}
    docs_train, docs_val = (list(d) for d in Chat(path="json", data_files=files, val_fraction=0.25).documents())
    assert docs_val == [chat.plain_text([("user", f"question {i}"), ("assistant", f"answer {i}")])
                        for i in sorted(questions(val))]
    assert len(docs_train) + len(docs_val) == 60


def test_val_split_knob_reads_another_split_of_a_local_dataset_directory(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": f"t{i}", "response": "r"} for i in range(5)])
    write_jsonl(folder / "test.jsonl", [{"prompt": "v0", "response": "r"}])
    tok = tokenizers.byte_tokenizer()
    train, val = Chat(path=str(folder), val_split="test").windows(req(tok, tmp_path / "cache"))
    assert "v0" in tok.decode(val.tokens) and "v0" not in tok.decode(train.tokens)
    assert (train.stats.conversations, val.stats.conversations) == (5, 1)


def test_cache_hit_reads_no_records_and_still_reports(tmp_path, monkeypatch, warnings_seen):
    records = [{"prompt": f"q{i}", "response": "y" * (50 if i == 0 else 3)} for i in range(20)]
    files = (write_jsonl(tmp_path / "c.jsonl", records),)
    tok, cache = tokenizers.byte_tokenizer(), tmp_path / "cache"
    first = Chat(path="json", data_files=files).windows(req(tok, cache, window=32))

    def no_reading(spec):
        raise AssertionError("cache hit expected, but records were read")

    monkeypatch.setattr(chat_source, "load_records", no_reading)
    warnings_seen.clear()
    again = Chat(path="json", data_files=files).windows(req(tok, cache, window=32))
    for a, b in zip(first, again):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
        assert a.stats == b.stats
    assert isinstance(again[0].tokens, np.memmap)
    assert any("truncated" in w for w in warnings_seen)  # never silent, even from the cache
    # Another window or val_fraction is another cache entry (so it reads the records); another
    # template too: test_a_template_change_is_another_cache_entry.
    for changed in (lambda: Chat(path="json", data_files=files).windows(req(tok, cache, window=48)),
                    lambda: Chat(path="json", data_files=files, val_fraction=0.1).windows(req(tok, cache, 32))):
        with pytest.raises(AssertionError, match="cache hit expected"):
            changed()


def test_a_template_change_is_another_cache_entry(tmp_path, monkeypatch, hf_backend):
    """The tokenizer's fingerprint does not cover its chat template: the cache key must, and the
    template knob too, or a changed template would train on the old rendering."""
    files = (write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"q{i}", "response": "r"} for i in range(20)]),)
    cache = tmp_path / "cache"
    chatml = hf_tok(tmp_path, hf_backend)
    other = hf_tok(tmp_path, hf_backend, "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert chatml.fingerprint == other.fingerprint  # same vocabulary: only the template tells them apart
    first = Chat(path="json", data_files=files).windows(req(chatml, cache))[0]

    def no_reading(spec):
        raise AssertionError("cache hit expected, but records were read")

    with monkeypatch.context() as m:
        m.setattr(chat_source, "load_records", no_reading)
        Chat(path="json", data_files=files).windows(req(chatml, cache))  # the same: a hit
        for tok, template in ((other, "auto"), (chatml, "plain")):
            with pytest.raises(AssertionError, match="cache hit expected"):
                Chat(path="json", data_files=files, template=template).windows(req(tok, cache))
    for tok, template in ((other, "auto"), (chatml, "plain")):
        rendered = Chat(path="json", data_files=files, template=template).windows(req(tok, cache))[0]
        assert chatml.decode(rendered.tokens) != chatml.decode(first.tokens)


def test_turns_closed_by_the_eot_stay_one_document_under_document_mask(tmp_path, hf_backend):
    """A template that ends every turn with the eot: the conversation is still one segment (its
    turns attend to each other), found from the packing's starts, not from the eots."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok = hf_tok(tmp_path, hf_backend, template)
    records = [{"prompt": f"q{i}", "response": "r"} for i in range(10)]
    src = Chat(path="json", data_files=(write_jsonl(tmp_path / "c.jsonl", records),), val_fraction=0.3)
    train, _ = src.windows(req(tok, tmp_path / "cache", window=64, document_mask=True))
    row = train.get(np.array([0]))
    tokens_W, seg_T, loss_T = row["tokens"][0], row["segment_ids"][0], row["loss_mask"][0]
    eots = np.flatnonzero(tokens_W[:-1] == tok.eot_id)
    assert len(eots) >= 4  # two per conversation
    # The first conversation's two eots (user turn, assistant turn) share one segment.
    assert seg_T[eots[0]] == seg_T[eots[1]] == seg_T[0] == 0 and seg_T[eots[2]] == 1
    # The assistant's turn right after the user's eot trains (no generation prompt in this template:
    # the whole turn, its first token included), though an eot precedes it.
    assert loss_T[eots[0]] == 1 and tok.decode(tokens_W[eots[0] + 1 : eots[1]]).startswith("assistant")


# --- bad input ------------------------------------------------------------------------------------


def test_a_bad_record_stops_the_run_naming_file_record_and_keys(tmp_path):
    records = [{"prompt": "q", "response": "a"}] * 5 + [{"text": "not a chat"}]
    src = Chat(path="json", data_files=(write_jsonl(tmp_path / "c.jsonl", records),))
    with pytest.raises(DataError, match=r"record 5 matches no chat format \(its keys: \['text'\]\)") as info:
        src.windows(req(tokenizers.byte_tokenizer(), tmp_path / "cache"))
    assert "c.jsonl" in str(info.value) and "skip_bad_records" in str(info.value)


def test_skip_bad_records_skips_counts_and_warns_once(tmp_path, warnings_seen):
    records = [{"prompt": f"q{i}", "response": "a"} for i in range(30)] + [{"text": "x"}] * 4
    src = Chat(path="json", data_files=(write_jsonl(tmp_path / "c.jsonl", records),), skip_bad_records=True)
    train, val = src.windows(req(tokenizers.byte_tokenizer(), tmp_path / "cache"))
    assert train.stats.skipped == 4 and train.stats.conversations + val.stats.conversations == 30
    (message,) = [w for w in warnings_seen if "skipped" in w]
    assert "skipped 4 of 34 records (11.8%)" in message and "keys: ['text']" in message


def test_no_usable_record_empty_or_missing_data_and_no_assistant_turn_fail_before_training(tmp_path):
    tok, cache = tokenizers.byte_tokenizer(), tmp_path / "cache"
    bad = (write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}] * 5),)
    with pytest.raises(DataError, match="train split has no usable conversation out of 5 records"):
        Chat(path="json", data_files=bad, skip_bad_records=True).windows(req(tok, cache))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError):
        Chat(path="json", data_files=(str(tmp_path / "empty.jsonl"),)).windows(req(tok, cache))
    with pytest.raises(DataError, match="dataset.data_files entry .*missing-\\*.jsonl' matches no files"):
        Chat(path="json", data_files=(str(tmp_path / "missing-*.jsonl"),)).windows(req(tok, cache))
    one = (write_jsonl(tmp_path / "one.jsonl", [{"prompt": "q", "response": "a"}]),)
    with pytest.raises(DataError, match="val split has no usable conversation.*dataset.val_fraction"):
        Chat(path="json", data_files=one, val_fraction=0.01).windows(req(tok, cache))
    users = [{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}] * 30
    with pytest.raises(DataError, match="no conversation .* has an assistant turn"):
        Chat(path="json", data_files=(write_jsonl(tmp_path / "u.jsonl", users),)).windows(req(tok, cache))


@pytest.mark.parametrize("knobs, match", [
    ({}, "dataset.path is empty"),
    ({"path": "json"}, r"dataset.path=json reads local files: set 'dataset.data_files"),
    ({"path": "data/chats.jsonl"}, "dataset.path='data/chats.jsonl' is a file name: use dataset.path=json"),
    ({"path": "json", "data_files": ["a.jsonl"], "val_split": "test"}, "dataset.val_split='test': local data_files"),
    ({"path": "org/ds", "val_split": "train"}, "dataset.val_split='train' is the training split"),
    ({"path": "org/ds", "val_fraction": 0.0}, r"dataset.val_fraction=0.0 must be in \(0, 1\)"),
    ({"path": "org/ds", "template": "chatml"}, "dataset.template='chatml' is unknown"),
])
def test_bad_knobs_are_config_errors(knobs, match):
    with pytest.raises(ConfigError, match=match):
        dataset_config({"name": "chat", **knobs})


@pytest.mark.parametrize("name", ["chat", "hf"])
def test_data_files_takes_one_glob_or_a_list_in_every_record_source(name, tmp_path):
    glob = write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"q{i}", "response": "a"} for i in range(20)])
    one = dataset_config({"name": name, "path": "json", "data_files": glob}).source
    assert one.data_files == (glob,) == dataset_config({"name": name, "path": "json",
                                                        "data_files": [glob]}).source.data_files
    for bad in ([], [""], [3], 3):
        with pytest.raises(ConfigError, match="data_files=.* must be null, a glob or a list of globs"):
            dataset_config({"name": name, "path": "json", "data_files": bad})
    if name == "chat":  # and the glob string reads the records
        train, val = one.windows(req(tokenizers.byte_tokenizer(), tmp_path / "cache"))
        assert train.stats.conversations + val.stats.conversations == 20


def test_yaml_is_registered_and_defaults_to_document_masks():
    from omegaconf import OmegaConf

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "dataset", "chat.yaml")
    node = OmegaConf.to_container(OmegaConf.load(conf))
    assert SOURCES["chat"] is Chat
    built = dataset_config({**node, "path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"})
    assert built.name == "chat" and built.document_mask is True
    assert built.source == Chat(path="HuggingFaceH4/ultrachat_200k", split="train_sft")
    with open(conf, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert all("#" in line for line in lines if line and not line.startswith("#"))  # every knob commented
