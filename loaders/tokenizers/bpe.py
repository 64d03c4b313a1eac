"""A GPT-2-style byte-level BPE trained with Hugging Face `tokenizers` on a sample of the train
split (`tokenizer=bpe`), cached under the run's cache_dir, and its config."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loaders import corpus
from loaders.tokenizers import EOT_TOKEN, Tokenizer, _digest
from utils.errors import ConfigError, DataError
from utils.files import atomic_write

# Bumped whenever the BPE recipe below changes, so old cached tokenizer files are not reused.
# v2: trained on a seeded random sample of the train split instead of its first documents.
_BPE_RECIPE = "bytelevel-bpe-v2"
# Fixed, not random_seed: runs of a seed sweep share one tokenizer (and its cache), so their losses compare.
BPE_SAMPLE_SEED = 0
# 256 bytes + the end-of-text token + at least one merge.
MIN_VOCAB_SIZE = 256 + 1 + 1


class BPETokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (Rust) behind the protocol; batch encoding is parallel."""

    def __init__(self, backend, name: str):
        self._tok = backend
        self.name = name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eot_id = backend.token_to_id(EOT_TOKEN)
        if eot_id is None:
            raise DataError(
                f"BPE tokenizer {name!r} has no {EOT_TOKEN} token: delete its cached file so it is retrained"
            )
        self.eot_id = int(eot_id)
        self.fingerprint = _digest("bpe", backend.to_str())  # the serialised tokenizer: vocab, merges, pipeline

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips the offsets we never use.
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        return self.encode_batch(texts)  # GPT-2's convention: no marks, the eot between documents is the only one

    def decode(self, ids) -> str:
        ids_N = np.asarray(ids).reshape(-1)
        ids_N = ids_N[(ids_N >= 0) & (ids_N < self.vocab_size)]
        # The ByteLevel decoder is lossy-UTF-8 in Rust: a cut multi-byte char becomes U+FFFD, not an error.
        return self._tok.decode(ids_N.tolist(), skip_special_tokens=True)


def _sample_hash(texts: Iterable[str]) -> str:
    """Content hash of the training sample, so a different corpus gets (and caches) its own BPE."""
    h = hashlib.md5(_BPE_RECIPE.encode())
    for text in texts:
        data = text.encode("utf-8", errors="replace")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        h.update(data)
    return h.hexdigest()[:16]


def _train_bpe(vocab_size: int, texts: Iterable[str]):
    """Train a GPT-2-style byte-level BPE; kept separate so tests can prove a cache hit skips it."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def bpe_tokenizer(
    vocab_size: int, sample_texts: Callable[[], Iterable[str]], cache_dir: str, sample_key: str | None = None
) -> Tokenizer:
    """Load the BPE trained on this sample from `cache_dir`, training and caching it on a miss.

    `sample_key` names the sample without reading it (e.g. corpus fingerprint + sample size + seed), so
    a hit reads no text at all; without it the sample's text is hashed. `sample_texts` is a callable
    so that a hit never builds the sample.
    """
    from tokenizers import Tokenizer as RustTokenizer

    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"tokenizer.vocab_size={vocab_size} is too small for byte-level BPE "
            f"(256 bytes + {EOT_TOKEN} + at least one merge): set it to >= {MIN_VOCAB_SIZE}, or use tokenizer=byte"
        )
    name = f"bpe-{vocab_size}"
    key = _digest(_BPE_RECIPE, vocab_size, sample_key) if sample_key is not None else _sample_hash(sample_texts())
    path = os.path.join(os.path.expanduser(cache_dir), f"{name}-{key}.json")
    if os.path.exists(path):
        try:
            return BPETokenizer(RustTokenizer.from_file(path), name)
        except Exception as e:  # a truncated or foreign file; the message says how to recover
            raise DataError(f"cached BPE tokenizer {path} cannot be read ({e}): delete it so it is retrained") from e

    backend = _train_bpe(vocab_size, sample_texts())
    with atomic_write(path) as tmp:  # another process training the same BPE never sees half a file
        backend.save(tmp)
    return BPETokenizer(backend, name)


def corpus_bpe_tokenizer(vocab_size: int, train_docs: Sequence[str], sample_docs: int, cache_dir: str) -> Tokenizer:
    """The BPE of a seeded random `sample_docs` of `train_docs`, cached under the corpus's stat
    fingerprint: a hit neither reads nor hashes the corpus text."""
    docs = corpus.in_memory_documents(train_docs)  # a lazy corpus.Documents passes through unread
    return bpe_tokenizer(
        vocab_size,
        lambda: corpus.sample_documents(docs, sample_docs, BPE_SAMPLE_SEED),
        cache_dir,
        sample_key=f"{docs.fingerprint}:sample_docs={sample_docs}:seed={BPE_SAMPLE_SEED}",
    )


@dataclass(frozen=True)
class BPE:
    name: ClassVar[str] = "bpe"
    needs_documents: ClassVar[bool] = True  # trained on the train split (read only when the cache misses)

    vocab_size: int = 4096  # ids to train, eot included
    sample_docs: int = 2000  # train-split documents it is trained on: a fixed random sample (all if fewer)

    def check(self, prefix: str) -> None:
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ConfigError(f"{prefix}.vocab_size={self.vocab_size} must be >= {MIN_VOCAB_SIZE} for a byte-level BPE")
        if self.sample_docs <= 0:
            raise ConfigError(f"{prefix}.sample_docs={self.sample_docs} must be positive")

    def build(self, train_docs: Sequence[str], cache_dir: str) -> Tokenizer:
        """The cached BPE of this corpus (trained on a miss): `cache_dir/bpe-<vocab>-<key>.json`."""
        return corpus_bpe_tokenizer(self.vocab_size, train_docs, self.sample_docs, cache_dir)
