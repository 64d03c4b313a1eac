"""The byte tokenizer (`tokenizer=byte`) and its config, which has no knobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loaders.tokenizers import Tokenizer, _digest


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

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        return self.encode_batch(texts)  # no marks: the eot between documents is the only one

    def decode(self, ids) -> str:
        ids_N = np.asarray(ids).reshape(-1)
        # A model can sample eot or (early in training) anything; keep only real bytes.
        bytes_N = ids_N[(ids_N >= 0) & (ids_N < 256)].astype(np.uint8)
        return bytes_N.tobytes().decode("utf-8", errors="replace")


def byte_tokenizer() -> Tokenizer:
    return ByteTokenizer()


@dataclass(frozen=True)
class Byte:
    name: ClassVar[str] = "byte"  # no knobs
    needs_documents: ClassVar[bool] = False

    def check(self, prefix: str) -> None:
        pass

    def build(self, train_docs: Sequence[str], cache_dir: str) -> Tokenizer:
        return ByteTokenizer()
