"""Data-source registry: `dataset.name` in a yaml -> the frozen dataclass that lists its documents.

Adding a source: one file here with a frozen dataclass (`name: ClassVar[str]`, its own knobs as
fields, `check(prefix)` raising ConfigError, `documents()` returning lazy (train, val)
`corpus.Documents`, usually through `corpus.lazy_splits`), one yaml in `conf/dataset/` holding its
knobs plus the batch knobs every source shares (`loaders.batching.BATCH_KNOBS`), one line below.
"""

from __future__ import annotations

from loaders.sources.stdlib import Stdlib
from loaders.sources.text_files import TextFiles

SOURCES = {
    "stdlib": Stdlib,
    "text_files": TextFiles,
}

__all__ = ["SOURCES", "Stdlib", "TextFiles"]
