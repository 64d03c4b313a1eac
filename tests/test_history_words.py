"""Code and docs speak to users, who never saw the documents this project grew from: no numbered
"seed" trainers (a seed followed by a three-digit number, `001_*` and the like), no "the seed's"
standing for one of them, no "seed trainer/pipeline/README". Name the behaviour, or the
public project (trainit) whose names and commands eqtrain keeps. A random seed is fine.
"""

from __future__ import annotations

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".py", ".md", ".yaml", ".yml")
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", "outputs", "multirun",
             "comparisons", "wandb"}
HISTORY = re.compile(
    r"\bseed[\s_`'-]*0\d\d"  # a numbered trainer, "seed 00N" or "seed `00N_*`"
    r"|\bthe seed(?:'|\u2019)s\b"  # "the seed's ...": a project ("a seed's effect", "each seed's" are random seeds)
    r"|\bseeds?[\s_]+(?:trainers?|pipelines?|projects?|repos?|repositor(?:y|ies)|readme)\b",
    re.IGNORECASE)
SELF = os.path.relpath(os.path.abspath(__file__), REPO)  # spells the words out, to test the pattern


def repo_files():
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in names:
            if name.endswith(SUFFIXES):
                yield os.path.relpath(os.path.join(root, name), REPO)


def hits(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


@pytest.mark.parametrize("line", [
    "the names of seed 003's pipeline", "Seed 001's set-up", "as the seed `001_*` trainer does",
    "the seed trainer `000_*`", "the seed's dashboards", "The seed\u2019s commands", "seed_002", "the seed README",
])
def test_the_pattern_finds_history_words(line):
    assert hits(line)


@pytest.mark.parametrize("line", [
    "train.seed=0", "with seed 0 (conf/hydra/sweeper/optuna_lr.yaml)", "batches in data_seed's order",
    "2 seeds give no verdict", "the seeds' mean val/loss curve", "a seed is no reference", "seed=1234",
    "the seed, not the corpus, picks it", "seeded random sample", "a seed's effect, shared by every optimizer",
    "the data order of every run (the first seed's)", "their seed's noise",
])
def test_the_pattern_leaves_random_seeds_alone(line):
    assert not hits(line)


def test_no_history_words_in_code_or_docs():
    found = {}
    for path in repo_files():
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as f:
            lines = hits(f.read())
        if lines and path != SELF:
            found[path] = lines
    assert not found, "words only the project's history explains (name the behaviour, or trainit): " + "; ".join(
        f"{path}:{n}: {line}" for path, lines in sorted(found.items()) for n, line in lines)
