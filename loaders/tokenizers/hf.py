"""Any Hugging Face `transformers` tokenizer (`tokenizer=hf`), for fine-tuning or comparing with
released models, and its config."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loaders.tokenizers import Tokenizer, _digest
from utils.errors import ConfigError


class TransformersTokenizer:
    """A `transformers` tokenizer behind the protocol, for fine-tuning or comparing with released models."""

    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name
        self.vocab_size = len(tok)  # len() counts added tokens; .vocab_size does not
        self.eot_id = int(tok.eos_token_id)
        self.doc_prefix, self.doc_suffix = document_marks(tok, self.eot_id)
        self.fingerprint = _hf_fingerprint(tok, self.doc_prefix, self.doc_suffix)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # verbose=False: documents are longer than model_max_length by design; we window them later.
        ids = self._tok(list(texts), add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each text between the marks the tokenizer's own encoding puts around one (`document_marks`)."""
        if not (len(self.doc_prefix) or len(self.doc_suffix)):
            return self.encode_batch(texts)
        return [np.concatenate([self.doc_prefix, ids, self.doc_suffix]) for ids in self.encode_batch(texts)]

    def decode(self, ids) -> str:
        ids_N = np.asarray(ids).reshape(-1)
        ids_N = ids_N[(ids_N >= 0) & (ids_N < self.vocab_size)]
        return self._tok.decode(ids_N.tolist(), skip_special_tokens=True)


_PROBE = "Hello world. 1 2 3"


def document_marks(tok, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids before, ids after) a text that the tokenizer's own encoding adds, as transformers encodes
    one (`tok(text)` against `tok(text, add_special_tokens=False)`): a Llama tokenizer's BOS
    (add_bos_token, or a post-processor template "<s> $A"), nothing for GPT-2's.

    The eot that the token stream puts after every document is not doubled: a trailing eot
    (add_eos_token) is left to that separator, and so is a leading one (a BOS that is the eot, as in
    GPT-2-style vocabularies: the eot before each document already starts it, and document masks
    then keep a document's first token with it). A tokenizer whose marked encoding does not
    contain the plain one (a post-processor that rewrites the text's ids) gets no marks."""
    plain = list(tok(_PROBE, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    full = list(tok(_PROBE, add_special_tokens=True, return_attention_mask=False)["input_ids"])
    empty = np.zeros(0, np.int32)
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if not plain or at is None:
        return empty, empty
    prefix, suffix = full[:at], full[at + len(plain) :]
    if prefix[:1] == [eot_id]:
        prefix = prefix[1:]
    if suffix[-1:] == [eot_id]:
        suffix = suffix[:-1]
    return np.asarray(prefix, np.int32).reshape(-1), np.asarray(suffix, np.int32).reshape(-1)


def _hf_fingerprint(tok, doc_prefix: np.ndarray, doc_suffix: np.ndarray) -> str:
    """Class + full serialised pipeline for fast tokenizers; class + vocab + added/special tokens
    otherwise. A hub name alone is not enough: a model repo's tokenizer can change under it.
    The document marks (`document_marks`) join it when there are any: token streams cached before
    documents were marked (they have no BOS) are not reused, those of unmarked tokenizers are."""
    if getattr(tok, "is_fast", False):
        body = tok.backend_tokenizer.to_str()
    else:
        body = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False)
    added = sorted((int(i), str(t)) for i, t in getattr(tok, "added_tokens_decoder", {}).items())
    marks = (("document marks", doc_prefix.tolist(), doc_suffix.tolist()),) if len(doc_prefix) or len(doc_suffix) \
        else ()
    return _digest("hf", type(tok).__name__, body, added, tok.eos_token_id, sorted(tok.all_special_tokens), *marks)


def _short_reason(e: Exception) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0]
    reason = f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__
    return reason if len(reason) <= 160 else reason[:157] + "..."


@contextlib.contextmanager
def quiet_transformers():
    """transformers' and the hub's warnings and info lines held back (errors still raise): a
    tokenizer load prints nothing the user of a JAX trainer can act on."""
    # The "PyTorch was not found" advisory is noise for a JAX trainer; set before transformers is imported.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    old_verbosity = hf_logging.get_verbosity()
    hub_logger = logging.getLogger("huggingface_hub")
    old_hub_level = hub_logger.level
    hf_logging.set_verbosity_error()
    hub_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(old_verbosity)
        hub_logger.setLevel(old_hub_level)


def hf_tokenizer(name_or_path: str) -> Tokenizer:
    """`AutoTokenizer.from_pretrained`, turning every load failure into one actionable line."""
    try:
        with quiet_transformers():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # noqa: BLE001 - hub/file/parse errors of many types: one line naming the knob
        raise ConfigError(
            f"tokenizer.name_or_path={name_or_path!r} cannot be loaded ({_short_reason(e)}): point it at a local "
            "tokenizer directory, or use tokenizer=byte / tokenizer=bpe which need no network"
        ) from None  # from None: the transformers traceback adds nothing the user can act on

    if tok.eos_token_id is None:
        raise ConfigError(
            f"tokenizer.name_or_path={name_or_path!r} defines no eos token to mark document ends: "
            "use a tokenizer that has one, or tokenizer=byte / tokenizer=bpe"
        )
    return TransformersTokenizer(tok, f"hf:{name_or_path}")


@dataclass(frozen=True)
class HF:
    name: ClassVar[str] = "hf"
    needs_documents: ClassVar[bool] = False

    name_or_path: str | None = None  # a hub name (network once, then the HF cache) or a local directory

    def check(self, prefix: str) -> None:
        if not self.name_or_path:
            raise ConfigError(f"{prefix}.name_or_path is empty: set it to a hub name or a local tokenizer directory")

    def build(self, train_docs: Sequence[str], cache_dir: str) -> Tokenizer:
        return hf_tokenizer(self.name_or_path)
