"""The data pipeline around the sources: document masks in the model, the exact masked mean of a
step, data_seed and the data fingerprint, prefetching, mixtures, and resuming every source."""

from __future__ import annotations

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import logits_atol, mean_loss_atol

from loaders.batching import BatchIterator
from loaders.prefetch import Prefetcher
from loaders.sources.mixture import ConcatWindows, MixtureTrain
from loaders.windows import WindowDataset, segment_ids
from models.gpt import GPT, GPTConfig
from models.losses import cross_entropy
from trainer.step import over_micro_batches, with_loss_norm
from utils.errors import CheckpointError, ConfigError

EOT = 0
TINY = GPTConfig(vocab_size=32, context_length=16, dim=32, num_heads=2, num_blocks=2)


@pytest.fixture(scope="module")
def model():
    return GPT(TINY, jax.random.PRNGKey(0))


# --- document masks: attention cannot cross a document boundary -------------------------------------


def test_changing_one_document_leaves_the_other_documents_logits_unchanged(model):
    rng = np.random.default_rng(0)
    # three packed documents: [0, 5) [5, 11) [11, 16), each ending with eot
    tokens_T = rng.integers(1, 32, 16)
    tokens_T[[4, 10, 15]] = EOT
    changed_T = tokens_T.copy()
    changed_T[5:10] = rng.integers(1, 32, 5)  # the middle document's text, not its eot
    both_2xT = jnp.asarray(np.stack([tokens_T, changed_T]), jnp.int32)
    seg_2xT = jnp.asarray(segment_ids(np.asarray(both_2xT), EOT))
    logits = jax.jit(lambda t, s: model(t, segment_ids_BxT=s))(both_2xT, seg_2xT)
    others = np.r_[0:5, 11:16]
    np.testing.assert_array_equal(logits[0, others], logits[1, others])
    assert not np.allclose(logits[0, 5:10], logits[1, 5:10])
    # Without segment ids the last document sees the changed one.
    plain = jax.jit(lambda t: model(t))(both_2xT)
    assert not np.allclose(plain[0, 11:], plain[1, 11:])
    # Block-causal attention (query blocks) masks documents the same way.
    blocked = GPT(dataclasses.replace(TINY, attn_block_size=4), jax.random.PRNGKey(0))  # same weights
    # Query blocks are another computation (softmaxes and products over fewer keys, other shapes):
    # equal up to float32 rounding of the whole forward pass, not bit for bit (here it is exact).
    # atol: logits_atol, mlp_ratio·dim·(blocks+1) float32 terms summed at max|logits| per side, two sides, 2x margin
    np.testing.assert_allclose(jax.jit(lambda t, s: blocked(t, segment_ids_BxT=s))(both_2xT, seg_2xT), logits,
                               rtol=0, atol=logits_atol(TINY, logits))


def test_a_documents_logits_do_not_depend_on_where_it_is_packed(model):
    """Positions restart at each document: a document packed after others gives the logits it
    gives first in a window (and alone, as when it is sampled)."""
    rng = np.random.default_rng(2)
    doc = np.r_[rng.integers(1, 32, 4), EOT]  # 5 tokens, its eot included
    before, after = np.r_[rng.integers(1, 32, 6), EOT], np.r_[rng.integers(1, 32, 4), EOT]
    first = np.r_[doc, before, rng.integers(1, 32, 4)]  # doc at [0, 5)
    later = np.r_[before, doc, after][:16]  # doc at [7, 12)
    tokens_3xT = jnp.asarray(np.stack([first, later, np.r_[doc, np.full(11, EOT)]]), jnp.int32)
    seg_3xT = jnp.asarray(segment_ids(np.asarray(tokens_3xT), EOT))
    logits = np.asarray(jax.jit(lambda t, s: model(t, segment_ids_BxT=s))(tokens_3xT, seg_3xT))
    alone = np.asarray(jax.jit(lambda t: model(t))(tokens_3xT[2:, :5]))[0]
    # float32 rounding only: a sum of n terms is exact to ~n·eps of the values' scale, and the
    # longest sums feeding a logit are the MLP's (mlp_ratio·dim terms), once per block and the head.
    n_terms = TINY.mlp_ratio * TINY.dim * (TINY.num_blocks + 1)
    tol = n_terms * np.finfo(np.float32).eps * np.abs(logits).max()
    np.testing.assert_allclose(logits[1, 7:12], logits[0, :5], rtol=0, atol=tol)
    np.testing.assert_allclose(alone, logits[0, :5], rtol=0, atol=tol)


# --- a masked loss is the exact mean over the step's masked-in targets -------------------------------


def test_a_masked_step_loss_is_the_mean_over_every_counted_target_not_of_micro_batch_means(model):
    rng = np.random.default_rng(1)
    tokens_AxBxT1 = jnp.asarray(rng.integers(1, 32, (2, 2, 17)), jnp.int32)
    mask_AxBxT = np.zeros((2, 2, 16), np.float32)
    mask_AxBxT[0, :, :2] = 1  # micro-batch 0: 4 targets
    mask_AxBxT[1, :, :12] = 1  # micro-batch 1: 24 targets
    batch = with_loss_norm({"tokens": tokens_AxBxT1, "loss_mask": jnp.asarray(mask_AxBxT)})

    loss, _ = over_micro_batches(lambda b, k: (cross_entropy(model, b, None, jnp.float32)[0], ()), batch,
                                 jnp.zeros((2, 2), jnp.uint32))
    logits = model(tokens_AxBxT1.reshape(4, 17)[:, :-1])
    targets = np.asarray(tokens_AxBxT1).reshape(4, 17)[:, 1:]
    nll_4xT = jax.nn.logsumexp(logits, -1) - np.take_along_axis(np.asarray(logits), targets[..., None], -1)[..., 0]
    mask_4xT = mask_AxBxT.reshape(4, 16)
    expected = float((nll_4xT * mask_4xT).sum() / mask_4xT.sum())
    # the step's scanned micro-batches and this eager forward are two programs: rounding of the
    # logits and of the 28 counted targets' mean
    # atol: mean_loss_atol, 2·logits_atol per token + its logsumexp's (V+1)·u rounding + the 28-term mean's, 2x margin
    np.testing.assert_allclose(float(loss), expected, rtol=0, atol=mean_loss_atol(TINY, logits, expected, 28))
    per_micro = [float((nll_4xT[i:i + 2] * mask_4xT[i:i + 2]).sum() / mask_4xT[i:i + 2].sum()) for i in (0, 2)]
    assert abs(np.mean(per_micro) - expected) > 1e-3  # the naive mean differs: the test can tell them apart


# --- data_seed and the fingerprint -----------------------------------------------------------------


def _corpus(tmp_path, n=30):
    rng = np.random.default_rng(0)
    root = tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    for i in range(n):
        (root / f"d{i:02d}.txt").write_text(" ".join("".join(rng.choice(list("abcdefgh"), 5)) for _ in range(40)))
    return f"{root}/*.txt"


def _data(tiny_run, tmp_path, *overrides, state=None):
    import train_jax

    run = tiny_run("dataset=text_files", f"dataset.paths=[{_corpus(tmp_path)}]", "dataset.val_fraction=0.2",
                   f"cache_dir={tmp_path / 'cache'}", *overrides)
    docs = run.dataset.source.documents()
    return train_jax.init_data(run, train_jax.init_tokenizer(run, docs[0]), docs, state)


def test_data_seed_alone_decides_the_data_order_and_fingerprint(tiny_run, tmp_path):
    a = _data(tiny_run, tmp_path, "random_seed=1", "data_seed=0")
    b = _data(tiny_run, tmp_path, "random_seed=2", "data_seed=0")
    c = _data(tiny_run, tmp_path, "random_seed=1", "data_seed=5")
    d = _data(tiny_run, tmp_path, "random_seed=5")  # data_seed null follows random_seed
    assert a.fingerprint == b.fingerprint != c.fingerprint == d.fingerprint
    for _ in range(3):
        np.testing.assert_array_equal(next(a.train), next(b.train))
    for data in (a, b, c, d):
        data.train.close()
    with pytest.raises(ConfigError, match="data_seed"):
        tiny_run("data_seed=-1")


# --- prefetch: the checkpointed state is the loop's, not the thread's -------------------------------


def _plain_iterator():
    return BatchIterator(WindowDataset(np.arange(60 * 5, dtype=np.uint32), 5), (2, 3), seed=3, shuffle=True)


def test_prefetch_yields_the_same_batches_and_checkpoints_the_consumed_position():
    # Prefetch threads left by other tests of this process (an in-process run's, until collected) are not ours.
    others = {t for t in threading.enumerate() if t.name == "eqtrain-prefetch"}
    reference, prefetched = _plain_iterator(), Prefetcher(_plain_iterator(), depth=3)
    assert prefetched.state_dict() == reference.state_dict()
    for _ in range(4):
        np.testing.assert_array_equal(next(prefetched), next(reference))
    # The thread has read ahead by now; the state is still that after the 4th batch.
    assert prefetched.state_dict() == reference.state_dict()
    resumed = Prefetcher(_plain_iterator(), depth=2)
    resumed.load_state_dict(json.loads(json.dumps(prefetched.state_dict())))
    for _ in range(6):
        np.testing.assert_array_equal(next(resumed), next(reference))
    prefetched.close(), resumed.close()
    assert not any(t.name == "eqtrain-prefetch" and t.is_alive() and t not in others for t in threading.enumerate())


class FailsAt:
    """A loader whose `at`-th batch raises "bad record" (and sets `failed` then)."""

    def __init__(self, at: int):
        self.n, self.at, self.failed = 0, at, threading.Event()

    def __next__(self):
        self.n += 1
        if self.n == self.at:
            self.failed.set()
            raise ValueError("bad record")
        return np.zeros(1)

    def state_dict(self):
        return {"n": self.n}


def test_a_loader_error_in_the_prefetch_thread_reaches_the_loop():
    it = Prefetcher(FailsAt(2), depth=2)
    next(it)
    with pytest.raises(ValueError, match="bad record"):
        next(it)


def test_closing_a_prefetcher_whose_loader_failed_behind_a_full_queue_ends_its_thread():
    """The loader fails while the queue is full and nobody reads: close() must still end the thread
    (its error was waiting for room in the queue, which never came)."""
    loader = FailsAt(3)
    it = Prefetcher(loader, depth=1)
    next(it)  # the thread starts: batch 2 fills the queue, then the loader fails on batch 3
    assert loader.failed.wait(10)
    it.close()
    assert not it._thread.is_alive()


# --- mixtures --------------------------------------------------------------------------------------


def _component(base, windows=40, window=5):
    return WindowDataset(base + np.arange(windows * window, dtype=np.uint32), window)


def _mixture(weights=(0.75, 0.25), masked_second=False):
    a = _component(0)
    b = _component(10_000) if not masked_second else WindowDataset(
        10_000 + np.arange(200, dtype=np.uint32), 5, loss_mask=np.ones(200, np.uint8) * (np.arange(200) % 2))
    return MixtureTrain(("a", "b"), (a, b), np.asarray(weights) / sum(weights))


def _tokens(batch):
    return batch["tokens"] if isinstance(batch, dict) else batch


def test_mixture_follows_the_weights_deterministically_and_resumes_exactly():
    mix = _mixture()
    it = mix.batches((2, 8), seed=4, process_index=0, process_count=1)
    batches = [next(it) for _ in range(50)]
    from_b = np.mean([(_tokens(b)[..., 0] >= 10_000).mean() for b in batches])
    assert 0.18 < from_b < 0.32  # 800 draws at p = 0.25
    for b in batches:
        assert (np.diff(_tokens(b), axis=-1) == 1).all()  # whole windows of one component each
    again = mix.batches((2, 8), seed=4, process_index=0, process_count=1)
    np.testing.assert_array_equal(next(again), batches[0])
    other = mix.batches((2, 8), seed=5, process_index=0, process_count=1)
    assert not np.array_equal(next(other), batches[0])
    resumed = mix.batches((2, 8), seed=4, process_index=0, process_count=1)
    resumed.load_state_dict(json.loads(json.dumps(again.state_dict())))
    for expected in batches[1:6]:
        np.testing.assert_array_equal(next(resumed), expected)
    with pytest.raises(CheckpointError, match="components"):
        resumed.load_state_dict({"batches": 1, "components": {"a": {}}})


def test_mixture_process_shares_concatenate_and_masked_components_mix_with_plain_ones():
    mix = _mixture(masked_second=True)
    whole = mix.batches((1, 8), seed=0, process_index=0, process_count=1)
    parts = [mix.batches((1, 8), seed=0, process_index=i, process_count=2) for i in range(2)]
    for _ in range(5):
        w, p = next(whole), [next(x) for x in parts]
        assert set(w) == {"tokens", "loss_mask"}
        for key in w:
            np.testing.assert_array_equal(np.concatenate([x[key] for x in p], axis=-2), w[key])
        from_a = w["tokens"][..., 0] < 10_000
        assert (w["loss_mask"][from_a] == 1).all()  # the plain component trains on every target


def test_mixture_honours_shuffle_false_each_component_in_its_own_order():
    from loaders.config import DatasetConfig
    from loaders.pipeline import batch_maker

    def component_windows(shuffle):
        it = batch_maker(_mixture(), DatasetConfig(batch_size=8, shuffle=shuffle), seed=4)(0, 1)
        firsts = np.concatenate([_tokens(next(it)).reshape(-1, 5)[:, 0] for _ in range(40)])  # 320 windows
        from_b = firsts >= 10_000
        return [(firsts[~from_b] // 5).tolist(), ((firsts[from_b] - 10_000) // 5).tolist()]

    for ids in component_windows(shuffle=False):
        assert len(ids) > 40 and ids == [i % 40 for i in range(len(ids))]  # 0, 1, 2, ... and wrapping
    assert all(ids[:40] != list(range(40)) for ids in component_windows(shuffle=True))


def test_mixture_validation_is_every_components_windows():
    val = ConcatWindows([_component(0, windows=3), _component(10_000, windows=2)])
    rows = val.get(np.arange(5))
    assert len(val) == 5 and rows[:, 0].tolist() == [0, 5, 10, 10_000, 10_005]


def test_mixture_config_errors_name_the_component(tiny_run):
    with pytest.raises(ConfigError, match="components.code.weight"):
        tiny_run("dataset=mixture", "dataset.components.code.weight=0")
    with pytest.raises(ConfigError, match="components.code.*unknown knob|unknown knob.*components.code"):
        tiny_run("dataset=mixture", "+dataset.components.code.paths=[x]")


def test_a_mixture_of_two_sources_builds_through_the_config(tiny_run, tmp_path):
    import train_jax

    corpus = _corpus(tmp_path)
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": f"note {i} " * 30}) + "\n" for i in range(20)))
    # As docs/data.md writes it: drop the yaml's example components, give your own.
    run = tiny_run("dataset=mixture", f"cache_dir={tmp_path / 'cache'}", "dataset.prefetch=0", "~dataset.components",
                   f"+dataset.components={{words: {{name: text_files, paths: ['{corpus}'], val_fraction: 0.2, "
                   f"weight: 3}}, notes: {{name: text_files, paths: ['{tmp_path}/notes.jsonl'], val_fraction: 0.2, "
                   "weight: 1}}")
    data = train_jax.init_data(run, train_jax.init_tokenizer(run, None))
    assert isinstance(data.val, ConcatWindows) and len(data.val.parts) == 2
    batch = next(data.train)
    assert batch.shape == (1, 8, 17) and len(data.fingerprint) == 12


# --- whole runs on the new sources, typed the way docs/data.md writes them -----------------------------


@pytest.mark.slow
def test_training_on_chat_and_memmap_data_with_relative_paths(tmp_path, monkeypatch):
    """Masked dict batches through the jitted step and the evaluation, token files read by
    memmap; each run logs its data fingerprint (and chat its truncation count) in the first record."""
    from helpers import compose_config

    import train_jax
    from loaders.sources.memmap import write_dataset
    from loaders.tokenizers.byte import ByteTokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    words = ["red", "green", "blue", "cyan"]
    chats = [{"messages": [{"role": "user", "content": str(rng.choice(words))},
                           {"role": "assistant", "content": str(rng.choice(words))}]} for _ in range(80)]
    (tmp_path / "data" / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    docs = [" ".join(rng.choice(words, 40)) for _ in range(20)]
    write_dataset("data/tok", {"train": docs[:16], "val": docs[16:]}, ByteTokenizer(), workers=1)

    common = ("model.vocab_size=null", "train.max_steps=4", "train.val_freq=4", "train.max_val_steps=2",
              f"cache_dir={tmp_path / 'cache'}")
    for name, overrides in {"chat": ("dataset=chat", "dataset.path=json", "dataset.data_files=[data/chats.jsonl]",
                                     "model.context_length=48", "dataset.val_fraction=0.2"),
                            "memmap": ("dataset=memmap", "dataset.path=data/tok")}.items():
        (tmp_path / name).mkdir()  # Hydra's run dir
        out = train_jax.train(compose_config(*common, *overrides), str(tmp_path / name))
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert len(first["data/fingerprint"]) == 12
        assert np.isfinite(out["train/loss"]) and np.isfinite(out["val/loss"])
        if name == "chat":
            assert first["data/truncated"] == 0 and first["data/conversations"] > 0
