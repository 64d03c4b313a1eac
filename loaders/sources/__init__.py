"""Data-source registry: `dataset.name` in a yaml -> the frozen dataclass that builds its data.

Adding a source: one file here with a frozen dataclass (`name: ClassVar[str]`, its own knobs as
fields, `check(prefix)` raising ConfigError), one yaml in `conf/dataset/` holding its knobs plus the
batch knobs every source shares (`loaders.config.BATCH_KNOBS`), one line below. The dataclass
gives its data in one of two ways:

- `documents() -> (train, val)`: text documents (`corpus.Documents`, usually through
  `corpus.lazy_splits`); the pipeline tokenizes them, caches the token stream and cuts windows.
- `windows(req: config.DataRequest) -> (train, val)`: sources that tokenize themselves or read
  token ids (memmap files, chat records with loss masks, streams). `val` is a `WindowDataset`;
  `train` is a `WindowDataset` (the pipeline's BatchIterator shuffles it) or a stream: any object
  with `batches(batch_shape, seed, process_index, process_count)` returning an iterator that has
  `state_dict()`/`load_state_dict()` and yields what BatchIterator yields. Such a source may also
  define `documents()` so tokenizers that train on text (tokenizer=bpe) can; without it they are
  refused with a ConfigError. `windows(req)` may return None to take the text path after all
  (hf: only its streaming mode builds its own windows).

All bad input (missing files, empty data, missing fields, malformed records) is a DataError or
ConfigError raised while building, before any compilation.
"""

from __future__ import annotations

from loaders.sources.chat import Chat
from loaders.sources.hf import HF
from loaders.sources.jsonl import Jsonl
from loaders.sources.memmap import Memmap
from loaders.sources.mixture import Mixture
from loaders.sources.stdlib import Stdlib
from loaders.sources.text_files import TextFiles

SOURCES = {
    "chat": Chat,
    "hf": HF,
    "jsonl": Jsonl,
    "memmap": Memmap,
    "mixture": Mixture,
    "stdlib": Stdlib,
    "text_files": TextFiles,
}

__all__ = ["SOURCES", "Stdlib", "TextFiles"]
