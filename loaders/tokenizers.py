"""Text <-> token ids: raw bytes, a byte-level BPE trained on the corpus, or any Hugging Face tokenizer.

All three answer the same small `Tokenizer` protocol so the rest of the pipeline never asks which
one it has. Ids come back as int32 numpy arrays (no jax here: the caller places batches on devices).
`decode` drops the end-of-text id in all three, so sampled text reads the same whichever is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from loaders import corpus
from utils.errors import ConfigError, DataError

EOT_TOKEN = "<|endoftext|>"
# Bumped whenever the BPE recipe below changes, so old cached tokenizer files are not reused.
# v2: trained on a seeded random sample of the train split instead of its first documents.
_BPE_RECIPE = "bytelevel-bpe-v2"
# Fixed, not random_seed: runs of a seed sweep share one tokenizer (and its cache), so their losses compare.
BPE_SAMPLE_SEED = 0


def _digest(*parts: object) -> str:
    h = hashlib.md5()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", errors="replace")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ("ab","c") != ("a","bc")
        h.update(data)
    return h.hexdigest()[:16]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the sampler need from a tokenizer, nothing more."""

    name: str  # e.g. "byte", "bpe-4096", "hf:gpt2"; for logs and readable cache file names
    # Short hash of what maps text to ids (vocabulary, merges, normalisation): two tokenizers that share
    # a name can still differ (BPEs trained on different samples), so caches of token ids key on this.
    fingerprint: str
    vocab_size: int  # number of ids it can emit, eot included: the model's embedding rows
    eot_id: int  # appended after every document so the model learns where documents end

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: needs no training, no files, no network, and never fails to encode."""

    name = "byte"
    vocab_size = 257
    eot_id = 256
    fingerprint = _digest("byte", "utf-8", "eot=256")  # nothing to train: the same ids forever

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids_N = np.asarray(ids).reshape(-1)
        # A model can sample eot or (early in training) anything; keep only real bytes.
        bytes_N = ids_N[(ids_N >= 0) & (ids_N < 256)].astype(np.uint8)
        return bytes_N.tobytes().decode("utf-8", errors="replace")


def byte_tokenizer() -> Tokenizer:
    return ByteTokenizer()


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

    min_size = 256 + 1 + 1
    if vocab_size < min_size:
        raise ConfigError(
            f"tokenizer.vocab_size={vocab_size} is too small for byte-level BPE "
            f"(256 bytes + {EOT_TOKEN} + at least one merge): set it to >= {min_size}, or use tokenizer=byte"
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
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Write then rename: a crash, or another process training the same BPE, never leaves half a file.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json.tmp")
    os.close(fd)
    try:
        backend.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
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


class TransformersTokenizer:
    """A `transformers` tokenizer behind the protocol, for fine-tuning or comparing with released models."""

    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name
        self.vocab_size = len(tok)  # len() counts added tokens; .vocab_size does not
        self.eot_id = int(tok.eos_token_id)
        self.fingerprint = _hf_fingerprint(tok)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # verbose=False: documents are longer than model_max_length by design; we window them later.
        ids = self._tok(list(texts), add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids) -> str:
        ids_N = np.asarray(ids).reshape(-1)
        ids_N = ids_N[(ids_N >= 0) & (ids_N < self.vocab_size)]
        return self._tok.decode(ids_N.tolist(), skip_special_tokens=True)


def _hf_fingerprint(tok) -> str:
    """Class + full serialised pipeline for fast tokenizers; class + vocab + added/special tokens
    otherwise. A hub name alone is not enough: a model repo's tokenizer can change under it."""
    if getattr(tok, "is_fast", False):
        body = tok.backend_tokenizer.to_str()
    else:
        body = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False)
    added = sorted((int(i), str(t)) for i, t in getattr(tok, "added_tokens_decoder", {}).items())
    return _digest("hf", type(tok).__name__, body, added, tok.eos_token_id, sorted(tok.all_special_tokens))


def _short_reason(e: Exception) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0]
    reason = f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__
    return reason if len(reason) <= 160 else reason[:157] + "..."


def hf_tokenizer(name_or_path: str) -> Tokenizer:
    """`AutoTokenizer.from_pretrained`, turning every load failure into one actionable line."""
    # The "PyTorch was not found" advisory is noise for a JAX trainer; set before transformers is imported.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    old_verbosity = hf_logging.get_verbosity()
    hub_logger = logging.getLogger("huggingface_hub")
    old_hub_level = hub_logger.level
    hf_logging.set_verbosity_error()
    hub_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:
        raise ConfigError(
            f"tokenizer.name_or_path={name_or_path!r} cannot be loaded ({_short_reason(e)}): point it at a local "
            "tokenizer directory, or use tokenizer=byte / tokenizer=bpe which need no network"
        ) from None  # from None: the transformers traceback adds nothing the user can act on
    finally:
        hf_logging.set_verbosity(old_verbosity)
        hub_logger.setLevel(old_hub_level)

    if tok.eos_token_id is None:
        raise ConfigError(
            f"tokenizer.name_or_path={name_or_path!r} defines no eos token to mark document ends: "
            "use a tokenizer that has one, or tokenizer=byte / tokenizer=bpe"
        )
    return TransformersTokenizer(tok, f"hf:{name_or_path}")
