"""Text <-> token ids: raw bytes, a byte-level BPE trained on the corpus, or any Hugging Face tokenizer.

All of them answer the same small `Tokenizer` protocol so the rest of the pipeline never asks which
one it has. Ids come back as int32 numpy arrays (no jax here: the caller places batches on devices).
`decode` drops the end-of-text id in all of them, so sampled text reads the same whichever is used.

Registry: `tokenizer.name` in a yaml -> the frozen config dataclass that builds one. Adding a
tokenizer: one file here with the tokenizer and its config (`name: ClassVar[str]`,
`needs_documents: ClassVar[bool]` (whether `build` reads the train split), its knobs as
fields, `check(prefix)` raising ConfigError, `build(train_docs, cache_dir) -> Tokenizer`), one
yaml in `conf/tokenizer/`, one line in TOKENIZERS below.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

import numpy as np

EOT_TOKEN = "<|endoftext|>"


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

    # Whole documents (the training stream, loaders/tokens.py), marked as the tokenizer's own encoding
    # marks a text: a Llama tokenizer's BOS first; the byte and BPE tokenizers add nothing. Never the
    # eot that the stream puts after every document. `encode_batch` is for pieces of text (chat turns).
    def encode_documents(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...


# Below the definitions above on purpose: each implementation imports them from this package.
from loaders.tokenizers.bpe import BPE, BPETokenizer, bpe_tokenizer, corpus_bpe_tokenizer  # noqa: E402 - after the protocol they import
from loaders.tokenizers.byte import Byte, ByteTokenizer, byte_tokenizer  # noqa: E402 - after the protocol they import
from loaders.tokenizers.hf import HF, TransformersTokenizer, hf_tokenizer  # noqa: E402 - after the protocol they import

TOKENIZERS = {
    "byte": Byte,
    "bpe": BPE,
    "hf": HF,
}

__all__ = [
    "EOT_TOKEN", "TOKENIZERS", "Tokenizer",
    "Byte", "ByteTokenizer", "byte_tokenizer",
    "BPE", "BPETokenizer", "bpe_tokenizer", "corpus_bpe_tokenizer",
    "HF", "TransformersTokenizer", "hf_tokenizer",
]
