"""The `dataset` section's batch knobs (`DatasetConfig`, `BATCH_KNOBS`) and what a source that
builds its own windows is given (`DataRequest`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loaders.tokenizers import Tokenizer
from utils.errors import ConfigError

# The knobs every data source shares, in `conf/dataset/*.yaml` beside the source's own.
BATCH_KNOBS = ("batch_size", "total_batch_size", "context_length", "shuffle", "document_mask", "prefetch")


@dataclass(frozen=True)
class DatasetConfig:
    """The `dataset` section: which source (built by `loaders.dataset_config`) and the batch shape."""

    name: str = "stdlib"  # the source's registry name (loaders.sources.SOURCES)
    source: Any = None  # that source's config dataclass, e.g. loaders.sources.Stdlib(...)
    batch_size: int = 32  # sequences per micro-batch, global (all devices together)
    total_batch_size: int | None = None  # sequences per optimizer step; null = batch_size
    context_length: int | None = None  # null = model.context_length
    shuffle: bool = True  # a fresh permutation of training windows every epoch
    document_mask: bool = False  # attention, loss and positions stay inside each document of a packed window
    prefetch: int = 2  # batches a background thread keeps ready; 0 = read in the loop

    def check(self, prefix: str) -> None:
        if self.batch_size <= 0:
            raise ConfigError(f"{prefix}.batch_size={self.batch_size} must be positive")
        total = self.total_batch_size
        if total is not None and (total <= 0 or total % self.batch_size):
            raise ConfigError(
                f"{prefix}.total_batch_size={total} must be a positive multiple of "
                f"{prefix}.batch_size={self.batch_size} (gradient accumulation = total / batch)"
            )
        if self.prefetch < 0:
            raise ConfigError(f"{prefix}.prefetch={self.prefetch} must be >= 0 (0 reads batches in the loop)")
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError(f"{prefix}.context_length={self.context_length} must be positive or null")

    def check_source(self, prefix: str) -> None:
        """What the batch knobs mean for this source (`source` set): a stream is shuffled by its own
        buffer, so shuffle=false there would silently do nothing."""
        buffer = getattr(self.source, "shuffle_buffer", 0)
        if not self.shuffle and getattr(self.source, "streaming", False) and buffer:
            raise ConfigError(f"{prefix}.shuffle=false does not order a stream ({prefix}.streaming=true): its "
                              f"{prefix}.shuffle_buffer={buffer} shuffles it; set {prefix}.shuffle_buffer=0 for the "
                              "stream's own order")

    @property
    def accum_steps(self) -> int:
        return (self.total_batch_size or self.batch_size) // self.batch_size


@dataclass(frozen=True)
class DataRequest:
    """What a source that builds its own windows (`windows(req)`) is given: see loaders/sources/__init__.py."""

    tokenizer: Tokenizer
    cache_dir: str
    window: int  # context_length + 1 tokens per row
    document_mask: bool = False  # rows carry segment ids; attention and loss stay inside each document
