"""Chat records -> (token ids, loss mask): the model is trained only on what the assistant says.

Record formats (the first that matches wins; see `to_turns`):
- `messages`: a list of {role, content} (OpenAI / Hugging Face style; any role string is kept);
- `conversations`: ShareGPT, a list of {from, value} with from in human/user -> user,
  gpt/assistant -> assistant, system -> system;
- `prompt` and `response` strings -> one user turn and one assistant turn.

Rendering (`render`, `render_many`), chosen by `template` (the source's `dataset.template`):
- "auto" with a Hugging Face tokenizer that has a `chat_template`: that template, rendered turn by
  turn. Turn i's text is the rendering of turns[:i+1] minus that of turns[:i] (a template that
  rewrites earlier turns when one is appended is refused: the turns could not be masked apart).
  An assistant turn's header (what `add_generation_prompt=True` adds, i.e. what a prompt at
  inference ends with) has mask 0 and the rest of its text, end-of-turn tokens included, mask 1.
  Each piece is tokenized on its own, which can differ from tokenizing the whole conversation at
  a piece boundary by a merge or two; accepted: the model sees the same text, and every
  conversation is cut the same way.
- otherwise (`template: plain`, or a tokenizer without one) the plain template, one line of header
  per turn:

      <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <eot>

  (`<|{role}|>` for other roles). Only each assistant's `{content}\\n` has mask 1: the header is
  given at inference, the newline ends the turn. Pieces meet at newlines, where a GPT-2-style
  pre-tokenizer splits anyway, so a byte-level BPE gives the ids of the whole text (except where
  a content starts or ends with extra whitespace, which can merge across the boundary).

Every conversation ends with the tokenizer's eot (not added twice when the template already ends
with it): mask 1 when the last turn is the assistant's (the model learns to stop), 0 otherwise.
Masks are uint8, 1 on tokens the model is trained to predict (the target side: WindowDataset
shifts them onto the inputs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from loaders.records import shown_keys
from loaders.tokenizers import Tokenizer, TransformersTokenizer
from utils.errors import DataError

FORMATS = ("`messages` (list of {role, content}), `conversations` (ShareGPT: list of {from, value}) "
           "or `prompt`+`response`")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TEMPLATES = ("auto", "plain")

# Bumped whenever what `render_many` produces for the same input changes: it keys the chat caches.
RENDER_RECIPE = "chat-render-v1"

Turns = list[tuple[str, str]]  # (role, content), role in user/assistant/system/... as the record says


class BadRecord(DataError):
    """One record cannot be used (no known format, a malformed turn, refused by the chat template):
    `dataset.skip_bad_records=true` skips these; every other DataError stops the run."""


def _turn(item, role_key: str, text_key: str, where: str, roles: dict | None) -> tuple[str, str]:
    if not isinstance(item, dict):
        raise BadRecord(f"{where}: a turn is {type(item).__name__}, not a mapping with {role_key!r} and {text_key!r}: "
                        "fix the record or set dataset.skip_bad_records=true")
    role, content = item.get(role_key), item.get(text_key)
    if not isinstance(role, str) or not isinstance(content, str):
        raise BadRecord(f"{where}: a turn lacks a string {role_key!r} or {text_key!r} (keys {sorted(item)}): "
                        "fix the record or set dataset.skip_bad_records=true")
    if roles is not None:
        if role.lower() not in roles:
            raise BadRecord(f"{where}: ShareGPT role {role_key}={role!r} is not one of {sorted(roles)}: "
                            "fix the record or set dataset.skip_bad_records=true")
        role = roles[role.lower()]
    return role, content


def to_turns(record: dict, where: str = "a record") -> Turns:
    """A record in any of the FORMATS -> [(role, content), ...]; `where` names it in errors
    (e.g. "data/chats.jsonl record 12"). Columns a format does not use may be None (datasets fills
    columns a row lacks), so a dataset may mix formats row by row."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where} is a {type(record).__name__}, not a mapping: give records with {FORMATS}")
    if isinstance(record.get("messages"), list):
        turns = [_turn(m, "role", "content", where, None) for m in record["messages"]]
    elif isinstance(record.get("conversations"), list):
        turns = [_turn(m, "from", "value", where, SHAREGPT_ROLES) for m in record["conversations"]]
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        turns = [("user", record["prompt"]), ("assistant", record["response"])]
    else:
        shown = shown_keys(k for k, v in record.items() if v is not None)
        raise BadRecord(f"{where} matches no chat format (its keys: {shown}): give each record {FORMATS}, "
                        "or set dataset.skip_bad_records=true to skip such records")
    if not turns:
        raise BadRecord(f"{where} is an empty conversation: remove it or set dataset.skip_bad_records=true")
    return turns


def uses_tokenizer_template(tok: Tokenizer, template: str = "auto") -> bool:
    return (template == "auto" and isinstance(tok, TransformersTokenizer)
            and bool(getattr(tok._tok, "chat_template", None)))


def template_fingerprint(tok: Tokenizer, template: str = "auto") -> str:
    """What picks the rendering beyond the tokenizer's fingerprint (which does not cover its chat template)."""
    if not uses_tokenizer_template(tok, template):
        return "plain"
    return hashlib.md5(str(tok._tok.chat_template).encode("utf-8", errors="replace")).hexdigest()[:16]


def plain_pieces(turns: Turns) -> list[tuple[str, int]]:
    """The plain template as (text, mask) pieces; see the module docstring."""
    pieces = []
    for role, content in turns:
        if role == "assistant":
            pieces += [("<|assistant|>\n", 0), (content + "\n", 1)]
        else:
            pieces.append((f"<|{role}|>\n{content}\n", 0))
    return pieces


def plain_text(turns: Turns) -> str:
    """The conversation as the plain template's text (documents for tokenizer=bpe to train on)."""
    return "".join(text for text, _ in plain_pieces(turns))


def _apply(hf_tok, messages: list[dict], generation: bool, where: str) -> str:
    try:
        return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except ImportError:  # not this record's fault: transformers renders templates with jinja2
        raise DataError("the tokenizer's chat_template needs the jinja2 package: pip install jinja2, "
                        "or set dataset.template=plain") from None
    except Exception as e:  # noqa: BLE001 - jinja's raise_exception (roles must alternate, no system role...)
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise BadRecord(f"{where}: the tokenizer's chat_template refuses it ({type(e).__name__}: {reason}): "
                        "fix the record, set dataset.skip_bad_records=true, or dataset.template=plain") from None


def template_pieces(turns: Turns, tok: TransformersTokenizer, where: str = "a record") -> list[tuple[str, int]]:
    """The tokenizer's chat template as (text, mask) pieces, rendered incrementally; see the module docstring."""
    hf_tok = tok._tok
    messages = [{"role": role, "content": content} for role, content in turns]
    pieces, prev = [], ""
    for i, (role, _) in enumerate(turns):
        full = _apply(hf_tok, messages[: i + 1], False, where)
        if not full.startswith(prev):
            raise DataError(
                f"{tok.name}'s chat_template renders {where}'s first {i + 1} turns as something other than its first "
                f"{i} turns plus more text (it rewrites earlier turns), so turns cannot be masked apart: "
                "set dataset.template=plain, or use a tokenizer whose template only appends"
            )
        if role == "assistant" and i > 0:
            head = _apply(hf_tok, messages[:i], True, where)
            if head.startswith(prev) and full.startswith(head):
                pieces += [(head[len(prev):], 0), (full[len(head):], 1)]
            else:  # the template has no generation prompt that this turn extends: train on all of it
                pieces.append((full[len(prev):], 1))
        else:
            pieces.append((full[len(prev):], int(role == "assistant")))
        prev = full
    return pieces


def pieces(turns: Turns, tok: Tokenizer, template: str = "auto", where: str = "a record") -> list[tuple[str, int]]:
    """(text, mask) pieces of one conversation, eot not included."""
    if uses_tokenizer_template(tok, template):
        return template_pieces(turns, tok, where)
    return plain_pieces(turns)


def render_many(conversations: Sequence[list[tuple[str, int]]], tok: Tokenizer,
                pieces_per_batch: int = 4096) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pieces of many conversations -> [(ids_N int32, mask_N uint8), ...], each ending with eot.
    All pieces go through `encode_batch` together (parallel in Rust for BPE/HF tokenizers)."""
    texts = [text for conv in conversations for text, _ in conv]
    ids_list = []
    for start in range(0, len(texts), pieces_per_batch):
        ids_list.extend(tok.encode_batch(texts[start : start + pieces_per_batch]))
    out, k = [], 0
    for conv in conversations:
        parts = ids_list[k : k + len(conv)]
        k += len(conv)
        ids_N = np.concatenate([np.asarray(p, np.int32) for p in parts] + [np.zeros(0, np.int32)])
        mask_N = np.concatenate([np.full(len(p), m, np.uint8) for p, (_, m) in zip(parts, conv)]
                                + [np.zeros(0, np.uint8)])
        last_is_assistant = bool(conv) and conv[-1][1] == 1
        if not (len(ids_N) and ids_N[-1] == tok.eot_id):  # a template that ends with eos already closes it
            ids_N = np.append(ids_N, np.int32(tok.eot_id))
            mask_N = np.append(mask_N, np.uint8(0))
        mask_N[-1] = last_is_assistant
        out.append((ids_N, mask_N))
    return out


def render(turns: Turns, tok: Tokenizer, template: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """One conversation -> (ids_N int32, mask_N uint8)."""
    return render_many([pieces(turns, tok, template)], tok)[0]
