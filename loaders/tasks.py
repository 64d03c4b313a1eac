"""Downstream tasks scored by log-likelihood (HellaSwag, ARC, PIQA, LAMBADA style): local JSONL
files read and checked, their examples tokenized as lm-evaluation-harness does, and the scoring
requests packed into a few fixed batch shapes. No JAX here: trainer/tasks.py runs the model.

One example per line, one kind per file (the first line decides):

    multiple choice  {"context": str, "choices": [str, ...], "gold": int}
    cloze            {"context": str, "continuation": str}

A request is one (context, continuation) pair: each choice of a multiple-choice example, the
continuation of a cloze one. Its tokens are lm-eval's `_encode_pair`: whitespace ending the
context moves to the continuation's front, the context and context + continuation are encoded
(as whole documents: a Llama tokenizer's BOS first), and the continuation's tokens are those
after the context's; an empty context is the end-of-text id alone. The sequence is
left-truncated to the model's context + 1 tokens (lm-eval keeps the last max_length + 1).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from utils.errors import DataError

CHOICE, CLOZE = "multiple_choice", "cloze"
KEYS = {CHOICE: ("context", "choices", "gold"), CLOZE: ("context", "continuation")}
MIN_BUCKET = 32  # the shortest padded length: below it a forward costs about the same


@dataclass(frozen=True)
class Task:
    name: str  # the file name without .jsonl: the metrics' eval/<name>/...
    path: str
    kind: str  # CHOICE | CLOZE
    contexts: tuple[str, ...]
    choices: tuple[tuple[str, ...], ...]  # a cloze example's one continuation
    golds: tuple[int, ...]  # a cloze example's 0
    lines: tuple[int, ...]  # each example's line in the file (for errors)


def task_name(path: str) -> str:
    base = os.path.basename(path)
    return base[: -len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]


def _kind(line: dict) -> str:
    return CLOZE if "continuation" in line and "choices" not in line else CHOICE


def read_task(path: str, max_examples: int | None = None) -> Task:
    """The first `max_examples` examples of `path` (None: all), every line checked: a bad one is a
    DataError naming the file, the line and the key."""
    contexts, choices, golds, lines, kind = [], [], [], [], None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"eval.tasks: cannot read {path} ({e.strerror}): give an existing JSONL file") from None
    with f:
        for number, text in enumerate(f, start=1):
            if max_examples is not None and len(contexts) >= max_examples:
                break
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not a JSON object ({e.msg}): write one example per line") from None
            if not isinstance(line, dict):
                raise DataError(f"{where}: not a JSON object: write one example per line")
            kind = kind or _kind(line)
            lines.append(number)
            contexts.append(_string(line, "context", where, kind))
            if kind == CLOZE:
                choices.append((_string(line, "continuation", where, kind, nonempty=True),))
                golds.append(0)
                continue
            options = line.get("choices")
            if not isinstance(options, list) or not options:
                raise DataError(f"{where}: key 'choices' must be a non-empty list of strings{_hint(line, kind)}")
            for i, option in enumerate(options):
                if not isinstance(option, str) or not option:
                    raise DataError(f"{where}: key 'choices' item {i} must be a non-empty string, got {option!r}")
            gold = line.get("gold")
            if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(options):
                raise DataError(f"{where}: key 'gold' must be an integer index into the {len(options)} choices "
                                f"(0..{len(options) - 1}), got {gold!r}{_hint(line, kind)}")
            choices.append(tuple(options))
            golds.append(gold)
    if not contexts:
        raise DataError(f"{path}: no examples: write one JSON object per line (docs/metrics.md#downstream-tasks)")
    return Task(task_name(path), path, kind, tuple(contexts), tuple(choices), tuple(golds), tuple(lines))


def _string(line: dict, key: str, where: str, kind: str, nonempty: bool = False) -> str:
    value = line.get(key)
    if not isinstance(value, str) or (nonempty and not value):
        got = "missing" if key not in line else f"{value!r}"
        raise DataError(f"{where}: key {key!r} must be a{' non-empty' * nonempty} string, got {got}"
                        f"{_hint(line, kind)}")
    return value


def _hint(line: dict, kind: str) -> str:
    """The file's kind (from its first line) and its keys, when this line is of another kind."""
    return f" (this file is {kind}: every line has {', '.join(KEYS[kind])})" if _kind(line) != kind else ""


def choice_length(choice: str) -> int:
    """acc_norm's length of a choice: lm-eval's `len(choice)`, the string's characters
    (lm_eval/api/task.py `completion_len`; the same as its bytes for ASCII text)."""
    return len(choice)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair`: trailing whitespace of the
    context moves to the continuation, the continuation's ids are those of context + continuation
    after the context's; an empty context is the end-of-text id (lm-eval's prefix token)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids, whole_ids = (np.asarray(ids, np.int32) for ids in
                              tokenizer.encode_documents([context, context + continuation]))
    continuation_ids = whole_ids[len(context_ids):]
    if not len(context_ids):
        context_ids = np.asarray([tokenizer.eot_id], np.int32)
    return context_ids, continuation_ids


def requests(task: Task, tokenizer, context_length: int) -> list[tuple[np.ndarray, int]]:
    """(tokens of at most context_length + 1, how many of the last are the continuation's) per
    request, example by example, choice by choice."""
    out = []
    for line, context, options in zip(task.lines, task.contexts, task.choices):
        for j, option in enumerate(options):
            context_ids, continuation_ids = encode_pair(tokenizer, context, option)
            n = len(continuation_ids)
            which = "key 'continuation'" if task.kind == CLOZE else f"key 'choices' item {j}"
            if not 0 < n <= context_length:
                raise DataError(f"{task.path}:{line}: {which} is {n} tokens; it must be 1 to the model's context of "
                                f"{context_length}: shorten it or raise dataset.context_length")
            out.append((np.concatenate([context_ids, continuation_ids])[-(context_length + 1):], n))
    return out


def buckets(context_length: int) -> tuple[int, ...]:
    """The padded lengths a batch takes: powers of two from MIN_BUCKET below the context, and the
    context itself (at most log2(context / MIN_BUCKET) + 1 compiled programs)."""
    lengths, n = [context_length], MIN_BUCKET
    while n < context_length:
        lengths.append(n)
        n *= 2
    return tuple(sorted(lengths))


@dataclass(frozen=True)
class Batch:
    inputs_BxL: np.ndarray  # int32 ids, right-padded with 0
    targets_BxL: np.ndarray  # int32: inputs shifted by one
    scored_BxL: np.ndarray  # bool: the continuation's targets
    rows_B: np.ndarray  # the request of each row; -1 for a padding row


def batches(reqs: Sequence[tuple[np.ndarray, int]], batch_size: int, context_length: int) -> Iterator[Batch]:
    """The requests, longest first (as lm-eval sorts them), in batches of `batch_size` rows padded to
    the smallest bucket that holds their longest input; the last batch of a bucket padded with
    rows that score nothing. A request's score does not depend on its batch: right padding is
    after every scored position of a causal model."""
    order = sorted(range(len(reqs)), key=lambda r: -len(reqs[r][0]))
    sizes = buckets(context_length)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        length = next(b for b in sizes if b >= len(reqs[rows[0]][0]) - 1)
        inputs, targets = np.zeros((2, batch_size, length), np.int32)
        scored = np.zeros((batch_size, length), bool)
        for b, r in enumerate(rows):
            tokens, n = reqs[r]
            t = len(tokens) - 1
            inputs[b, :t], targets[b, :t] = tokens[:-1], tokens[1:]
            scored[b, t - n:t] = True
        yield Batch(inputs, targets, scored, np.asarray(rows + [-1] * (batch_size - len(rows))))
