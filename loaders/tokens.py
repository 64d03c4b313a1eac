"""Documents -> one token stream (each document followed by the eot), cached on disk and
memory-mapped on a hit; `cached_windows` cuts that stream into a `WindowDataset`."""

from __future__ import annotations

import os

import numpy as np

from loaders.corpus import in_memory_documents
from loaders.tokenizers import Tokenizer
from loaders.windows import WindowDataset
from utils.errors import DataError
from utils.files import atomic_write


def token_dtype(vocab_size: int) -> np.dtype:
    """Half the memory and disk of int32 for every vocabulary up to 64k ids, which is most of them."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def tokenize_documents(
    docs: list[str], tok: Tokenizer, cache_path: str | None = None, docs_per_batch: int = 512
) -> np.ndarray:
    """Encode and concatenate `docs`, each followed by `tok.eot_id`; reuse `cache_path` if it exists.
    Each document is marked as the tokenizer marks a text (`encode_documents`: a Llama tokenizer's
    BOS at its start), so a fine-tuned model sees its documents as it saw them in pretraining.

    The cache is trusted as is: the caller's path must encode corpus, split and tokenizer (see
    `corpus.corpus_fingerprint`). A hit is memory-mapped, so a large corpus costs no RAM up front.
    """
    dtype = token_dtype(tok.vocab_size)
    if cache_path is not None and os.path.exists(cache_path):
        tokens = np.load(cache_path, mmap_mode="r")
        if tokens.ndim == 1 and tokens.dtype == dtype:
            return tokens
        # A file of the wrong kind cannot be this tokenizer's output: recompute and overwrite it.

    eot_1 = np.array([tok.eot_id], dtype=np.int32)
    chunks = []
    for start in range(0, len(docs), docs_per_batch):
        ids_list = tok.encode_documents(list(docs[start : start + docs_per_batch]))  # parallel in Rust for BPE/HF
        chunk = np.concatenate([part for ids in ids_list for part in (np.asarray(ids, np.int32), eot_1)])
        if chunk.size and (chunk.min() < 0 or chunk.max() >= tok.vocab_size):
            raise DataError(
                f"tokenizer {tok.name!r} emitted id {int(chunk.max())} outside its vocab_size={tok.vocab_size}: "
                "its vocab_size is wrong; use another tokenizer.name_or_path or tokenizer=byte"
            )
        chunks.append(chunk.astype(dtype))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)

    if cache_path is not None:
        with atomic_write(cache_path) as tmp, open(tmp, "wb") as f:
            np.save(f, tokens)  # a file object: given a path, np.save would append .npy to the tmp name
    return tokens


def cached_windows(docs, tokenizer: Tokenizer, cache_dir: str, source: str, split: str, window: int,
                   document_mask: bool = False) -> WindowDataset:
    """`docs` tokenized (or read from `cache_dir/tokens/`) and cut into windows of `window` tokens.
    The cache is keyed by the tokenizer's fingerprint (not its name: two BPEs share one) and the
    split's stat fingerprint, so a hit reads no corpus text and a retrained tokenizer never reuses ids."""
    docs = in_memory_documents(docs)  # a lazy corpus.Documents passes through unread
    readable = tokenizer.name.replace("/", "_").replace(":", "_")
    name = f"{source}-{split}-{readable}-{tokenizer.fingerprint}-{docs.fingerprint}.npy"
    tokens = tokenize_documents(docs, tokenizer, os.path.join(cache_dir, "tokens", name))
    return WindowDataset(tokens, window, eot_id=tokenizer.eot_id, document_mask=document_mask)
