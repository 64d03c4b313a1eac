"""Fixed windows of context_length+1 tokens cut from a 1-D token stream, with loss masks and
document segments: `WindowDataset`, and helpers for the rows it returns.

numpy only, views where it can: a window is a reshape of the stream, never a Python loop over tokens.
"""

from __future__ import annotations

import numpy as np

from utils.errors import DataError


def segment_ids(inputs_NxT: np.ndarray, eot_id: int) -> np.ndarray:
    """Document index of every input position, counted from the row's start: a document's eot
    belongs to it, the token after the eot starts the next one."""
    is_eot = (inputs_NxT == eot_id).astype(np.int32)
    return np.cumsum(is_eot, axis=-1) - is_eot


class WindowDataset:
    """Windows of `window` = context_length+1 tokens cut from a 1-D token stream (an array or a memmap).

    Window i at `offset` is stream[offset + i*window : offset + (i+1)*window]; `len()` counts the
    windows at offset 0 and `max_offset` is how far they can shift (the stream's leftover tokens, at
    most window-1), so a trainer can move the window boundaries every epoch. `aligned=True` pins
    them in every epoch (a stream laid out in window-sized bins, e.g. packed chat conversations).

    A row is the int32 token window, or a dict when the stream has a loss mask or documents are
    masked (`document_mask`): `tokens` (window), `loss_mask` (window-1, float32: 1 where the target
    token is trained on) and, with `document_mask`, `segment_ids` (window-1: attention stays inside
    each document, and the loss skips a target that starts the next document). Documents start
    after each eot, or where `doc_starts` (a uint8 stream beside the tokens) holds 1.
    Windows may start mid-document and span document ends: without document masks, the eot between
    documents is what tells the model a new one began.
    """

    def __init__(self, tokens: np.ndarray, window: int, *, loss_mask: np.ndarray | None = None,
                 eot_id: int | None = None, document_mask: bool = False, aligned: bool = False,
                 doc_starts: np.ndarray | None = None):
        tokens = np.asarray(tokens) if not isinstance(tokens, np.memmap) else tokens
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if window < 2:
            raise ValueError(f"window must be context_length+1 >= 2, got {window}")
        if loss_mask is not None and np.shape(loss_mask) != tokens.shape:
            raise ValueError(f"loss_mask has shape {np.shape(loss_mask)}, the tokens {tokens.shape}")
        if document_mask and eot_id is None and doc_starts is None:
            raise ValueError("document_mask needs the tokenizer's eot_id or the documents' starts")
        if doc_starts is not None and np.shape(doc_starts) != tokens.shape:
            raise ValueError(f"doc_starts has shape {np.shape(doc_starts)}, the tokens {tokens.shape}")
        num_windows = len(tokens) // window
        if num_windows == 0:
            raise DataError(
                f"the dataset has {len(tokens)} tokens, fewer than one window of model.context_length+1={window}: "
                "give the dataset more text (or raise dataset.val_fraction if this is the validation split), "
                "or lower model.context_length"
            )
        self.window = window
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.eot_id = eot_id
        self.document_mask = bool(document_mask)
        self.doc_starts = doc_starts
        self.num_windows = num_windows
        self.aligned = bool(aligned)  # the boundaries are the data's: never moved, no window dropped
        self.max_offset = 0 if aligned else min(window - 1, len(tokens) - num_windows * window)
        # A reshape of a contiguous prefix is a view: no copy of the stream, even when it is a memmap.
        self.windows_NxW = tokens[: num_windows * window].reshape(num_windows, window)

    def __len__(self) -> int:
        return self.num_windows

    @property
    def masked(self) -> bool:
        """Whether rows are dicts (a loss mask or segment ids) rather than bare token arrays."""
        return self.loss_mask is not None or self.document_mask

    def _rows(self, stream: np.ndarray, idx_N: np.ndarray, offset: int) -> np.ndarray:
        if offset == 0:
            return stream[: self.num_windows * self.window].reshape(self.num_windows, self.window)[idx_N]
        return stream[(idx_N * self.window + offset)[:, None] + np.arange(self.window)]

    def get(self, idx, offset: int = 0):
        """Rows for window indices `idx` (any shape) at `offset`: leaves of shape idx.shape + (...).
        int32 tokens: the embedding lookup wants signed ids, the stream stores uint16."""
        idx = np.asarray(idx)
        idx_N = idx.reshape(-1)
        if not 0 <= offset < self.window or (len(idx_N) and
                                             (idx_N.max() + 1) * self.window + offset > len(self.tokens)):
            raise ValueError(f"windows {idx_N.max()} at offset {offset} run past the stream's "
                             f"{len(self.tokens)} tokens")
        tokens_NxW = np.asarray(self._rows(self.tokens, idx_N, offset), dtype=np.int32)
        if not self.masked:
            return tokens_NxW.reshape(idx.shape + (self.window,))
        W = self.window
        weights_NxT = (np.ones((len(idx_N), W - 1), np.float32) if self.loss_mask is None
                       else np.asarray(self._rows(self.loss_mask, idx_N, offset)[:, 1:], np.float32))
        row = {"tokens": tokens_NxW}
        if self.document_mask:
            if self.doc_starts is None:  # a document starts after each eot
                starts_NxW = np.zeros(tokens_NxW.shape, np.int32)
                starts_NxW[:, 1:] = tokens_NxW[:, :-1] == self.eot_id
            else:  # given (chat templates may close every turn with the eot)
                starts_NxW = np.asarray(self._rows(self.doc_starts, idx_N, offset), np.int32)
            # segment of input t = starts in (0, t]; no loss on a target that starts the next document
            row["segment_ids"] = np.cumsum(starts_NxW[:, :-1], axis=-1) - starts_NxW[:, :1]
            weights_NxT = weights_NxT * (1 - starts_NxW[:, 1:])
        row["loss_mask"] = weights_NxT
        return {k: v.reshape(idx.shape + v.shape[1:]) for k, v in row.items()}


def concat_rows(rows: list):
    """Rows from several `get` calls (arrays or dicts alike) joined along the first axis."""
    if isinstance(rows[0], dict):
        return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    return np.concatenate(rows)


def batch_tokens(batch) -> np.ndarray:
    """The token array of a batch, whichever form it has."""
    return batch["tokens"] if isinstance(batch, dict) else batch
