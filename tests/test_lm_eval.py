"""An exported model (`scripts/export_model.py --format hf`) under lm-evaluation-harness itself (the
parity tier: lm-eval, transformers, torch): docs/metrics.md's offline `lm_eval --model hf ...`
command, parsed by lm-eval's own command line and run through `lm_eval.simple_evaluate` on the
docs' task yaml over a tiny local JSONL file (no download), gives the acc and acc_norm that our own
`eval.tasks` scorer (trainer/tasks.py) gives the same examples on the checkpoint's JAX model, and
the same log-likelihood per choice.

The two sides are two programs (PyTorch on the exported float32 weights, JAX on the checkpoint's):
a choice's summed log-probability of n tokens errs by n times one token's (helpers.mean_loss_atol),
and an accuracy is compared exactly only where every example's decision is further apart than
both sides' errors together (checked first: otherwise the test could not tell a bug from rounding).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script, mean_loss_atol, train_on_own_source

from loaders import tasks as tasklib
from loaders.tokenizers import ByteTokenizer
from trainer import inference, tasks
from utils.parallel import mesh as meshlib

pytest.importorskip("transformers", reason="parity tier: pip install -e '.[dev,parity]'")
pytest.importorskip("torch", reason="parity tier: pip install -e '.[dev,parity]'")
lm_eval = pytest.importorskip("lm_eval", reason="parity tier: pip install -e '.[dev,parity]' (lm-eval)")

ROOT = Path(__file__).resolve().parent.parent
C = 32  # the run's context: the long example below is left-truncated by both sides
# test_run_export.py's quick-compiling tiny run (byte tokens), trained on this repository's code
RUN = ("model.vocab_size=null", "train.sample_tokens=0", "train.max_steps=12", "train.skip_validation=true",
       f"model.context_length={C}", "model.remat=none", "model.scan_blocks=false", "optimizer=adamw",
       "optimizer/lr_config=constant", "checkpoint.save=true", "dataset=text_files",
       "dataset.val_fraction=0.2")
LINES = [  # a space ends the context and no choice starts with one (lm-eval's target_delimiter "")
    {"context": "def f(x):\n    return ", "choices": ["x", "self", "None"], "gold": 0},
    {"context": "import ", "choices": ["numpy as np", "qqq", "jax"], "gold": 2},
    {"context": "for i in ", "choices": ["range(n):", "zzz"], "gold": 0},
    {"context": "class A:\n    def __init__(self, ", "choices": ["cfg", "x"], "gold": 1},
    {"context": "long line " * 5 + "of ", "choices": ["code", "the"], "gold": 1},  # 53 bytes > C + 1
    {"context": "", "choices": ["a", "import"], "gold": 1},  # empty: the end-of-text id alone
]
DOC = ROOT / "docs" / "metrics.md"


def docs_task_yaml() -> str:
    """docs/metrics.md's block (```text: the docs' fences are bash, python or text) of the task yaml."""
    blocks = re.findall(r"```text\n(.*?)```", DOC.read_text(), re.S)
    mine = [b for b in blocks if "\ntask: my_task\n" in b]
    assert len(mine) == 1, f"docs/metrics.md: {len(mine)} yaml blocks define my_task (the docs changed)"
    return mine[0]


def docs_lm_eval_args(monkeypatch):
    """docs/metrics.md's offline `lm_eval ... --include_path` command, parsed by lm-eval's CLI."""
    from lm_eval._cli import HarnessCLI

    lines = [line.split(" # ")[0] for line in DOC.read_text().splitlines()
             if line.startswith("lm_eval ") and "--include_path" in line]
    assert len(lines) == 1, f"docs/metrics.md: {len(lines)} offline lm_eval commands (the docs changed)"
    monkeypatch.setattr(sys, "argv", shlex.split(lines[0]))
    return HarnessCLI().parse_args()


@pytest.fixture(scope="module")
def export(tmp_path_factory, _cache_dir) -> tuple[Path, Path]:
    """(checkpoint dir, its --format hf export) of a tiny run of 12 AdamW steps."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    train_on_own_source(tmp, _cache_dir, *RUN, "checkpoint.save_path=ck")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        assert load_script("export_model").main(["ck", "--format", "hf", "--out", "hf"]) == 0
    return tmp / "ck", tmp / "hf"


def ours(ckpt: Path, data: str):
    """(our scorer's metrics, each request's log-likelihood, each request's atol) on the checkpoint."""
    _, run, model = inference.restore_for_inference(str(ckpt), "latest")
    tok = ByteTokenizer()
    scorer = tasks.TaskScorer([data], tok, C, 4, meshlib.make_mesh(1, 1, 4, devices=jax.devices()[:1]), "float32")
    reqs = scorer.requests[0]
    loglik, _ = scorer.scores(model, reqs)
    atols = []
    # A sum of n tokens' log-probabilities from two float32 programs: n × helpers.mean_loss_atol (each
    # token's two logits' error, its logsumexp's rounding, the sum's; margin 4 = two sides × 2), at the
    # scale of the request's own logits (its forward alone, the scored positions).
    for tokens, n in reqs:
        logits_TxV = np.asarray(model(jnp.asarray(tokens[None, :-1]), key=None, compute_dtype="float32"))[0]
        atols.append(n * mean_loss_atol(run.model, logits_TxV[-n:], abs(loglik[len(atols)]) / n, n))
    return scorer(model), loglik, np.asarray(atols), scorer.tasks[0]


@pytest.mark.slow  # a 12-step run, its export, lm-eval's import and evaluation: 32-51 s measured on 2 shared cores
def test_the_docs_lm_eval_command_on_the_export_gives_our_scorers_accuracies(export, tmp_path, monkeypatch):
    import datasets
    from lm_eval.tasks import TaskManager

    ckpt, hf_dir = export
    monkeypatch.chdir(tmp_path)  # the docs' relative paths: hf_model/, my_tasks/
    (tmp_path / "hf_model").symlink_to(hf_dir)
    (tmp_path / "my_tasks").mkdir()
    data = tmp_path / "my_tasks" / "my_task.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    (tmp_path / "my_tasks" / "my_task.yaml").write_text(docs_task_yaml())
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")  # not the user's cache
    args = docs_lm_eval_args(monkeypatch)
    assert (args.model, args.model_args["pretrained"], args.device) == ("hf", "hf_model", "cpu")
    out = lm_eval.simple_evaluate(model=args.model, model_args=args.model_args, tasks=args.tasks,
                                  task_manager=TaskManager(include_path=args.include_path), device=args.device,
                                  batch_size=args.batch_size, log_samples=True)
    theirs = out["results"]["my_task"]
    samples = sorted(out["samples"]["my_task"], key=lambda s: s["doc_id"])
    their_ll = np.array([float(r[0]) for s in samples for r in s["filtered_resps"]], np.float64)

    metrics, loglik, atol, task = ours(ckpt, str(data))
    assert len(their_ll) == len(loglik) == sum(len(line["choices"]) for line in LINES)
    # the same tokens scored, choice by choice: within n tokens' float32 error of two programs (ours' atol)
    assert (np.abs(their_ll - loglik) <= atol).all(), (their_ll, loglik, atol)
    # Every decision (raw, and per character) clear of both sides' errors, so the accuracies compare
    # exactly: each side's score is within atol of the other's, so a gap above 2·atol cannot flip.
    start = 0
    for options in task.choices:
        k, chars = len(options), np.array([tasklib.choice_length(o) for o in options], np.float64)
        ll, err = loglik[start: start + k], atol[start: start + k]
        start += k
        for score, bound in ((ll, err), (ll / chars, err / chars)):
            best = int(np.argmax(score))
            assert (score[best] - np.delete(score, best) > 2 * bound.max()).all(), (options, score, bound)
    assert theirs["acc,none"] == metrics["eval/my_task/acc"]
    assert theirs["acc_norm,none"] == metrics["eval/my_task/acc_norm"]
