"""Every source through the same pipeline (loaders.pipeline.build_data, as train_jax builds it):
resuming at step k gives the batches an uninterrupted run gives next, and simulated processes
read disjoint row shares that together make the global batch. Tiny local fixtures, byte tokens."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import train_jax
from loaders.config import DataRequest
from loaders.pipeline import build_data, source_documents
from loaders.sources.memmap import write_dataset
from loaders.tokenizers.byte import ByteTokenizer
from loaders.windows import batch_tokens
from utils.errors import CheckpointError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)

    def text(n):
        return " ".join(rng.choice(WORDS, n))

    (root / "txt").mkdir()
    for i in range(16):
        (root / "txt" / f"d{i:02d}.txt").write_text(text(30))
    (root / "records.jsonl").write_text("".join(json.dumps({"text": text(25), "title": f"record {i}"}) + "\n"
                                                for i in range(40)))
    chats = [{"messages": [{"role": "user", "content": text(1)}, {"role": "assistant", "content": text(1)}]}
             for _ in range(60)]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    docs = [text(30) for _ in range(30)]
    write_dataset(str(root / "tokens"), {"train": docs[:24], "val": docs[24:]}, ByteTokenizer(), workers=1)
    return root


def overrides(name: str, root) -> list[str]:
    return {
        "text_files": ["dataset=text_files", f"dataset.paths=[{root}/txt/*.txt]", "dataset.val_fraction=0.25"],
        "jsonl": ["dataset=jsonl", f"dataset.paths=[{root}/records.jsonl]", "dataset.val_fraction=0.2",
                  "dataset.text_field=[title,text]"],
        "hf": ["dataset=hf", "dataset.path=json", f"dataset.data_files=[{root}/records.jsonl]",
               "dataset.val_fraction=0.2"],
        "hf_streaming": ["dataset=hf", "dataset.path=json", f"dataset.data_files=[{root}/records.jsonl]",
                         "dataset.streaming=true", "dataset.shuffle_buffer=8", "dataset.max_val_documents=8"],
        "memmap": ["dataset=memmap", f"dataset.path={root}/tokens"],
        "chat": ["dataset=chat", "dataset.path=json", f"dataset.data_files=[{root}/chats.jsonl]",
                 "dataset.val_fraction=0.2", "model.context_length=48"],  # whole conversations, a few per window
        "mixture": ["dataset=mixture", "~dataset.components",
                    f"+dataset.components={{files: {{name: text_files, paths: ['{root}/txt/*.txt'], "
                    f"val_fraction: 0.25, weight: 2}}, tokens: {{name: memmap, path: '{root}/tokens', weight: 1}}}}"],
        "mixture_chat": ["dataset=mixture", "~dataset.components", "model.context_length=48",
                         f"+dataset.components={{files: {{name: text_files, paths: ['{root}/txt/*.txt'], "
                         f"val_fraction: 0.25, weight: 1}}, chat: {{name: chat, path: json, "
                         f"data_files: ['{root}/chats.jsonl'], val_fraction: 0.2, weight: 1}}}}"],
    }[name]


SOURCE_NAMES = ["text_files", "jsonl", "hf", "hf_streaming", "memmap", "chat", "mixture"]


def _build(tiny_run, root, name, *extra, process=(0, 1), state=None, prefetch=2):
    run = tiny_run(*overrides(name, root), f"cache_dir={root / 'cache'}", f"dataset.prefetch={prefetch}",
                   "dataset.total_batch_size=16", *extra)  # 2 micro-batches of 8
    docs = source_documents(run.dataset.source, False, "byte")
    tok = train_jax.init_tokenizer(run, None)
    req = DataRequest(tok, run.cache_dir, run.context_length + 1, run.dataset.document_mask)
    return build_data(run.dataset, req, run.data_seed, *process, docs, state)


def _equal(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    else:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", SOURCE_NAMES)
def test_resume_at_step_k_gives_the_next_batches_of_an_uninterrupted_run(tiny_run, fixtures, name):
    for k in (1, 7):  # 7 batches of 16 windows run past an epoch of every fixture
        data = _build(tiny_run, fixtures, name)
        for _ in range(k):
            next(data.train)
        state = json.loads(json.dumps(data.train.state_dict()))  # as the checkpoint manifest stores it
        expected = [next(data.train) for _ in range(3)]
        data.train.close()
        resumed = _build(tiny_run, fixtures, name, state=state, prefetch=0)
        for batch in expected:
            _equal(next(resumed.train), batch)
        assert resumed.fingerprint == data.fingerprint
    assert batch_tokens(batch).shape[:2] == (2, 8)


@pytest.mark.parametrize("name", SOURCE_NAMES)
def test_two_processes_read_disjoint_shares_that_make_the_global_batch(tiny_run, fixtures, name):
    whole = _build(tiny_run, fixtures, name, prefetch=0)
    parts = [_build(tiny_run, fixtures, name, process=(i, 2), prefetch=0) for i in range(2)]
    for _ in range(3):
        global_batch, shares = next(whole.train), [next(p.train) for p in parts]
        assert batch_tokens(shares[0]).shape[:2] == (2, 4)
        if isinstance(global_batch, dict):
            _equal({k: np.concatenate([s[k] for s in shares], axis=-2) for k in global_batch}, global_batch)
        else:
            _equal(np.concatenate(shares, axis=-2), global_batch)


def test_a_mixtures_chat_component_keeps_whole_conversations_in_every_epoch(tiny_run, fixtures):
    """The chat component's windows are packed bins: in every epoch each comes whole, at its own
    boundaries, exactly once (a shifted window would cut conversations and train answers without
    their prompts)."""
    data = _build(tiny_run, fixtures, "mixture_chat", prefetch=0)
    chat_ds = data.train.datasets[data.train.names.index("chat")]
    bins = Counter(tuple(row) for row in np.asarray(chat_ds.tokens).reshape(-1, chat_ds.window).tolist())
    n = len(chat_ds)
    assert n >= 3 and sum(bins.values()) == n  # (short conversations repeat: bins may too)
    rows: list[tuple] = []
    while len(rows) < 3 * n:  # the chat component's first three epochs
        tokens = batch_tokens(next(data.train)).reshape(-1, chat_ds.window)
        rows += [tuple(r) for r in tokens.tolist() if ord("<") in r]  # "<|user|>": chat; the words have no "<"
    for epoch in range(3):
        got = rows[epoch * n : (epoch + 1) * n]
        assert all(r in bins for r in got), f"epoch {epoch}: a chat window is not one of the packed bins"
        assert Counter(got) == bins, f"epoch {epoch}: not every bin once"


@pytest.mark.parametrize("saved_by, resumed_as", [("mixture", "text_files"), ("hf_streaming", "memmap"),
                                                   ("text_files", "mixture"), ("memmap", "hf_streaming")])
def test_a_data_state_of_another_kind_of_dataset_is_a_checkpoint_error_naming_both(tiny_run, fixtures, saved_by,
                                                                                   resumed_as):
    """checkpoint.overwrite_config=true may switch dataset=mixture (or a stream) to a windows source:
    the saved iterator state cannot resume it, and the error says why in one line."""
    data = _build(tiny_run, fixtures, saved_by, prefetch=0)
    next(data.train)
    state = json.loads(json.dumps(data.train.state_dict()))
    kinds = {"mixture": "mixture", "hf_streaming": "stream", "text_files": "windows", "memmap": "windows"}
    with pytest.raises(CheckpointError, match=f"is a {kinds[saved_by]} state but this run's dataset gives "
                                              f"{kinds[resumed_as]}") as info:
        _build(tiny_run, fixtures, resumed_as, state=state)
    assert "\n" not in str(info.value)
