"""The run's tokenizer written into a Hugging Face directory so that `AutoTokenizer.from_pretrained(dir)`
encodes every text to the ids the run trained on (models/hf.py's `save_hf` calls `keep_run_ids`).

Writing `tokenizer.json` is not enough: transformers 5 picks the tokenizer class from config.json's
`model_type` for some types whatever `tokenizer_config.json` names (`qwen2` is in
`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, transformers/models/auto/tokenization_auto.py), and
`Qwen2Tokenizer` keeps only the vocabulary and merges of tokenizer.json: its own pre-tokenizer
regex and NFC normaliser replace ours, so `"\\n    "` becomes 2 ids instead of 1. The one route the
loader leaves to the file's own pipeline is a custom tokenizer class (`auto_map` in
tokenizer_config.json): without `trust_remote_code` transformers then skips the model type's class
for these types and loads `tokenizer_class` (TokenizersBackend: tokenizer.json as written); with
it, it imports the class from `tokenization_eqtrain.py`, a TokenizersBackend with no code of its own.

`keep_run_ids` checks what AutoTokenizer really loads against the run's tokenizer on PROBES (newlines,
indentation, tabs, CRLF, digits, accents composed and not, CJK, an emoji, the end-of-text text),
pins the class only when they differ (gpt2 and llama directories keep the plain files), and refuses
the export in one line if the ids still differ.
"""

from __future__ import annotations

import json
import os

from utils import files
from utils.errors import CheckpointError

TOKENIZER_CONFIG = "tokenizer_config.json"
MODULE_FILE = "tokenization_eqtrain.py"
CLASS_REF = "tokenization_eqtrain.EqtrainTokenizer"
_MODULE_SOURCE = '''"""Written by eqtrain's export: tokenizer.json as saved (no model type's own pipeline)."""

from transformers import TokenizersBackend


class EqtrainTokenizer(TokenizersBackend):
    pass
'''

PROBES = (
    "def f(x_BxT):\n    return x\n\n\n        y = 1\n",
    "\tif a:\r\n\t\tb = '''c'''  # 0123456789 3.14159 1e-5",
    "héllo ünïcode e\u0301 caf\u00e9 日本語のテキスト 🙂 ﬁ Ⅷ",
    "  leading and trailing spaces   \n \n",
    "<|endoftext|>text after<|endoftext|>",
)


def byte_backend():
    """The byte tokenizer (id = UTF-8 byte, 256 = end of text) as a `tokenizers.Tokenizer`: a
    byte-level BPE with no merges, each byte's GPT-2 character at its own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from loaders.tokenizers import EOT_TOKEN, ByteTokenizer

    # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's): printable bytes map to
    # themselves, the others to 256, 257, ... in byte order.
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    char = {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    backend = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOT_TOKEN, special=True)])
    assert backend.token_to_id(EOT_TOKEN) == ByteTokenizer.eot_id
    return backend


def hf_tokenizer_object(tokenizer):
    """The run's tokenizer as a transformers tokenizer, or None (no tokenizer)."""
    from loaders.tokenizers import EOT_TOKEN, BPETokenizer, ByteTokenizer, TransformersTokenizer

    if isinstance(tokenizer, TransformersTokenizer):
        return tokenizer._tok
    if isinstance(tokenizer, (BPETokenizer, ByteTokenizer)):
        from transformers import PreTrainedTokenizerFast

        # GPT-2's convention: the end-of-text token is also bos and unk (byte-level BPE never needs unk).
        # The byte tokenizer reads "<|endoftext|>" in a text as its 13 bytes: split_special_tokens says so.
        is_byte = isinstance(tokenizer, ByteTokenizer)
        return PreTrainedTokenizerFast(tokenizer_object=byte_backend() if is_byte else tokenizer._tok,
                                       eos_token=EOT_TOKEN, bos_token=EOT_TOKEN, unk_token=EOT_TOKEN,
                                       split_special_tokens=is_byte)
    return None


def auto_tokenizer_ids(out_dir: str, texts) -> tuple[str, list[list[int]]]:
    """(the class name, the ids of each text) of `AutoTokenizer.from_pretrained(out_dir)`, quietly."""
    from loaders.tokenizers.hf import quiet_transformers

    with quiet_transformers():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out_dir)
        return type(tok).__name__, [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def first_difference(out_dir: str, tokenizer) -> str | None:
    """None when AutoTokenizer encodes every probe as `tokenizer` does; else what differs, in words."""
    try:
        name, got = auto_tokenizer_ids(out_dir, PROBES)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a directory it cannot load
        return f"AutoTokenizer cannot load it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    for text, ids in zip(PROBES, got):
        want = [int(i) for i in tokenizer.encode(text)]
        if ids != want:
            return (f"AutoTokenizer loads {name}, which encodes {text!r} as {len(ids)} ids, "
                    f"the run's tokenizer as {len(want)}")
    return None


def pin_class(out_dir: str) -> list[str]:
    """tokenizer_config.json names TokenizersBackend and the custom class (module docstring); the module beside it."""
    path = os.path.join(out_dir, TOKENIZER_CONFIG)
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(tokenizer_class="TokenizersBackend", auto_map={"AutoTokenizer": [None, CLASS_REF]})
    with files.atomic_write(os.path.join(out_dir, MODULE_FILE)) as tmp:
        with open(tmp, "w") as f:
            f.write(_MODULE_SOURCE)
    with files.atomic_write(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return [MODULE_FILE]


def keep_run_ids(out_dir: str, tokenizer) -> list[str]:
    """After config.json and the tokenizer files are in OUT_DIR: make AutoTokenizer give the run's ids
    (module docstring). Returns the files it added; CheckpointError if the ids still differ."""
    if hf_tokenizer_object(tokenizer) is None or first_difference(out_dir, tokenizer) is None:
        return []
    added = pin_class(out_dir)
    why = first_difference(out_dir, tokenizer)
    if why is not None:
        raise CheckpointError(f"{out_dir}: {why}: transformers would tokenize this export differently from the "
                              "run; use --format safetensors (eqtrain's export), or report it with your transformers "
                              "version")
    return added
