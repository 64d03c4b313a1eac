"""eval.tasks (loaders/tasks.py, trainer/tasks.py): downstream tasks scored by log-likelihood.

The scores are checked against lm-evaluation-harness's rule re-derived here, one request at a time,
without padding: the byte tokenizer's ids typed out (UTF-8 bytes, the context's trailing whitespace
moved onto the continuation, an empty context as the end-of-text id), the sequence left-truncated to
context + 1 tokens, the model called on it alone and its logits turned into log-probabilities in
float64. Tolerances: a request's summed log-probability of n tokens errs by n times one token's
(helpers.mean_loss_atol: the logits of two programs, each side's logsumexp) plus the sum's rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, mean_loss_atol

import train_jax
from loaders import tasks as tasklib
from loaders.tokenizers import ByteTokenizer
from trainer import tasks
from utils.config import resolve_vocab, validate
from utils.errors import ConfigError, DataError
from utils.parallel import mesh as meshlib

C = 64  # the model's context here: requests fall in both buckets, 32 and 64, and one is truncated
RUN = (f"model.context_length={C}", "model.vocab_size=null")  # byte ids: vocab 257, padded to 320
FAMILIES = {"gpt": (), "llama": ("model=llama_tiny",)}  # llama at the tiny overrides' dim 32, 2 blocks

CHOICE_LINES = [
    {"context": "The cat sat on the ", "choices": ["mat", "hat", "rug"], "gold": 0},
    {"context": "", "choices": ["a", "b"], "gold": 1},  # empty context: the end-of-text id alone
    {"context": "long " * 20 + "and so ", "choices": ["x", "yz"], "gold": 0},  # 107 bytes: left-truncated
    {"context": "Zoë went to the café and ", "choices": ["ordered", "éclair"], "gold": 1},
]
CLOZE_LINES = [  # the same lengths as choice requests: the reference compiles one program per length
    {"context": "the fox ran by the", "continuation": " dog"},
    {"context": "to be or not to be, that is it", "continuation": " now"},
]


def write(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return str(path)


@functools.cache
def setup(family: str):
    run = resolve_vocab(validate(compose_config(*RUN, *FAMILIES[family])), 257)
    model = eqx.filter_jit(lambda key: train_jax.init_model(run, key))(jax.random.PRNGKey(0))  # not op by op
    return run, model


def one_device_mesh(batch_size: int):
    return meshlib.make_mesh(1, 1, batch_size, devices=jax.devices()[:1])


@eqx.filter_jit
def forward(model, tokens_1xT):
    return model(tokens_1xT)


def reference(model, context: str, continuation: str):
    """(log-likelihood, all greedy, the scored positions' logits, tokens) of one request, alone."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids, whole = list(context.encode()), list((context + continuation).encode())
    continuation_ids = whole[len(context_ids):]
    seq = ((context_ids or [256]) + continuation_ids)[-(C + 1):]
    logits_TxV = np.asarray(forward(model, jnp.asarray([seq[:-1]])), np.float64)[0]
    n, targets = len(continuation_ids), np.asarray(seq[1:])
    scored = np.arange(len(seq) - 1 - n, len(seq) - 1)
    top = logits_TxV[scored].max(-1, keepdims=True)
    logp = logits_TxV[scored] - (top + np.log(np.exp(logits_TxV[scored] - top).sum(-1, keepdims=True)))
    ll = float(logp[np.arange(n), targets[scored]].sum())
    return ll, bool((logits_TxV[scored].argmax(-1) == targets[scored]).all()), logits_TxV[scored], n


def atol(cfg, logits, ll: float, n: int) -> float:
    """A sum of n tokens' log-probabilities: n times the mean's atol (helpers.mean_loss_atol)."""
    return n * mean_loss_atol(cfg, logits, abs(ll) / n, n)


def with_garbage_padding(batches):
    """tasklib.batches with every position after a row's last target (and every padding row) random ids."""
    def wrapped(*args, **kwargs):
        rng = np.random.default_rng(1)
        for b in batches(*args, **kwargs):
            L = b.inputs_BxL.shape[1]
            end = np.where(b.scored_BxL.any(1), L - np.argmax(b.scored_BxL[:, ::-1], axis=1), 0)
            pad = np.arange(L)[None, :] >= end[:, None]
            yield dataclasses.replace(b, inputs_BxL=np.where(pad, rng.integers(0, 257, pad.shape), b.inputs_BxL)
                                      .astype(np.int32))
    return wrapped


# --- reading the files ---------------------------------------------------------------------------

def test_reads_both_kinds_caps_examples_and_names_tasks_by_file(tmp_path):
    choice = tasklib.read_task(write(tmp_path / "arc.jsonl", CHOICE_LINES), max_examples=3)
    assert (choice.name, choice.kind, choice.golds, choice.lines) == ("arc", tasklib.CHOICE, (0, 1, 0), (1, 2, 3))
    assert choice.choices[0] == ("mat", "hat", "rug")
    cloze = tasklib.read_task(write(tmp_path / "lambada.jsonl", CLOZE_LINES))
    assert (cloze.kind, cloze.choices, cloze.golds) == (tasklib.CLOZE, ((" dog",), (" now",)), (0, 0))


@pytest.mark.parametrize("lines, line, key", [
    ([CHOICE_LINES[0], {"choices": ["a"], "gold": 0}], 2, "'context'"),
    ([CHOICE_LINES[0], {"context": "x", "choices": ["a", "b"], "gold": 2}], 2, "'gold'"),
    ([{"context": "x", "choices": ["a", "b"], "gold": True}], 1, "'gold'"),
    ([{"context": "x", "choices": "ab", "gold": 0}], 1, "'choices'"),
    ([{"context": "x", "choices": ["a", ""], "gold": 0}], 1, "'choices' item 1"),
    ([CLOZE_LINES[0], {"context": "x"}], 2, "'continuation'"),
    ([CLOZE_LINES[0], CHOICE_LINES[0]], 2, "'continuation'"),  # a multiple-choice line in a cloze file
    ([CHOICE_LINES[0], CLOZE_LINES[0]], 2, "'choices'"),
])
def test_a_bad_line_is_refused_in_one_line_naming_the_file_line_and_key(tmp_path, lines, line, key):
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as e:
        tasklib.read_task(path)
    assert f"{path}:{line}: key {key}" in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_json_lines_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CLOZE_LINES[0]) + "\n\n" + "not json\n")
    with pytest.raises(DataError, match=f"{path}:3: not a JSON object"):
        tasklib.read_task(str(path))
    with pytest.raises(DataError, match="cannot read"):
        tasklib.read_task(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("overrides, message", [
    (("eval.tasks=[a/x.jsonl,b/x.jsonl]",), "eval.tasks names two files x.jsonl"),
    (("eval.tasks=[x.jsonl]", "objective=mdlm"), "objective=mdlm attends both ways"),
    (("eval.every=0",), "eval.every=0 must be a positive integer"),
    (("eval.max_examples=-1",), "eval.max_examples=-1 must be a positive integer"),
])
def test_bad_knobs_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose_config(*overrides))
    assert "\n" not in str(e.value)


# --- encoding and batching -----------------------------------------------------------------------

def test_requests_encode_as_lm_eval_and_truncate_from_the_left(tmp_path):
    tok = ByteTokenizer()
    context_ids, continuation_ids = tasklib.encode_pair(tok, "The cat ", "sat")
    assert bytes(context_ids.tolist()) == b"The cat" and bytes(continuation_ids.tolist()) == b" sat"
    assert tasklib.encode_pair(tok, "", "a")[0].tolist() == [tok.eot_id]
    task = tasklib.read_task(write(tmp_path / "t.jsonl", CHOICE_LINES))
    reqs = tasklib.requests(task, tok, C)
    assert [n for _, n in reqs] == [4, 4, 4, 1, 1, 2, 3, 8, 8]  # " mat" ... " ordered", " éclair" (8 bytes)
    long_tokens, _ = reqs[5]
    assert len(long_tokens) == C + 1 and bytes(long_tokens.tolist()).endswith(b"so x")
    with pytest.raises(DataError, match=r"t.jsonl:4: key 'choices' item 0 is 8 tokens; it must be 1 to"):
        tasklib.requests(task, tok, 7)


def test_requests_of_a_trained_bpe_split_where_the_context_ends(tmp_path):
    """The continuation's ids are those of context + continuation after the context's (lm-eval's split)."""
    from loaders import tokenizers

    bpe = tokenizers.bpe_tokenizer(300, lambda: ["the quick brown fox jumps " * 40], str(tmp_path))
    context_ids, continuation_ids = tasklib.encode_pair(bpe, "the quick brown ", "fox")
    assert context_ids.tolist() == bpe.encode("the quick brown").tolist()
    assert [*context_ids, *continuation_ids] == bpe.encode("the quick brown fox").tolist()
    assert bpe.decode(continuation_ids) == " fox"


@pytest.mark.slow  # ~4 s: importing transformers
def test_a_llama_style_hf_tokenizer_marks_the_context_with_its_bos(tmp_path):
    """As the training stream marks a document: BOS first; an empty context is then the BOS alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loaders import tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", tokenizers.EOT_TOKEN, "hello", "world", "fine"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=True, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    hf = tokenizers.hf_tokenizer(str(tmp_path))
    assert [x.tolist() for x in tasklib.encode_pair(hf, "hello world ", "fine")] == [[1, 4, 5], [6]]
    assert [x.tolist() for x in tasklib.encode_pair(hf, "", "fine")] == [[1], [6]]


def test_batches_have_a_few_fixed_shapes_and_one_program_serves_every_evaluation(tmp_path, monkeypatch):
    """Two tasks of 13 requests, batch 3: traced (compiled) once per bucket used, never again."""
    assert tasklib.buckets(1024) == (32, 64, 128, 256, 512, 1024) and tasklib.buckets(100) == (32, 64, 100)
    run, model = setup("gpt")
    traced, real = [], tasks.request_scores
    monkeypatch.setattr(tasks, "request_scores", lambda m, inputs, *rest, **kw: traced.append(inputs.shape)
                        or real(m, inputs, *rest, **kw))  # a Python side effect: runs while tracing only
    tasks.scoring_step.cache_clear()
    try:
        paths = [write(tmp_path / "choice.jsonl", CHOICE_LINES), write(tmp_path / "cloze.jsonl", CLOZE_LINES)]
        scorer = tasks.TaskScorer(paths, ByteTokenizer(), C, 3, one_device_mesh(3), "float32")
        first = scorer(model)
        assert sorted(traced) == [(3, 32), (3, 64)]
        assert scorer(model) == first and len(traced) == 2  # the same programs, the same values
    finally:
        tasks.scoring_step.cache_clear()


# --- scores against the one-at-a-time reference --------------------------------------------------

@pytest.mark.parametrize("family, batch_size", [("gpt", 3), pytest.param("gpt", 1, marks=pytest.mark.slow),
                                                pytest.param("llama", 3, marks=pytest.mark.slow)])  # 2-3 s each
def test_scores_equal_a_per_example_reference(tmp_path, monkeypatch, family, batch_size):
    """Each request's summed log-probability and greedy flag, and so acc, acc_norm and loglik, as the
    model scores each request alone, unpadded; whatever the batch size, the other rows and what the
    padding holds (random ids after each row's end: a causal model never reads them for its targets)."""
    run, model = setup(family)
    monkeypatch.setattr(tasklib, "batches", with_garbage_padding(tasklib.batches))
    paths = [write(tmp_path / "choice.jsonl", CHOICE_LINES), write(tmp_path / "cloze.jsonl", CLOZE_LINES)]
    scorer = tasks.TaskScorer(paths, ByteTokenizer(), C, batch_size, one_device_mesh(batch_size), "float32")
    bounds, tols, certain = {}, {}, 0
    for task, reqs in zip(scorer.tasks, scorer.requests):
        loglik, greedy = scorer.scores(model, reqs)
        pairs = [(c, o) for c, options in zip(task.contexts, task.choices) for o in options]
        refs = [reference(model, c, o) for c, o in pairs]
        outcomes = []  # per request: whether it is greedy, (surely, possibly)
        for got_ll, got_greedy, (ll, all_greedy, logits, n) in zip(loglik, greedy, refs):
            np.testing.assert_allclose(got_ll, ll, rtol=0, atol=atol(run.model, logits, ll, n))
            top2 = np.sort(logits, axis=-1)[:, -2:]
            near_tie = (top2[:, 1] - top2[:, 0]).min() <= 2 * atol(run.model, logits, ll, n)  # either side may flip
            assert near_tie or got_greedy == all_greedy
            outcomes.append((all_greedy and not near_tie, all_greedy or near_tie))
        lls, tol = np.array([r[0] for r in refs]), max(atol(run.model, r[2], r[0], r[3]) for r in refs)
        if task.kind == tasklib.CLOZE:
            bounds[f"eval/{task.name}/loglik"] = (lls.mean(), lls.mean())
            tols[f"eval/{task.name}/loglik"] = tol  # a mean of log-likelihoods, each within tol
            bounds[f"eval/{task.name}/acc"] = tuple(np.mean([o[k] for o in outcomes]) for k in (0, 1))
            continue
        acc, norm, start = np.zeros(2), np.zeros(2), 0
        for options, gold in zip(task.choices, task.golds):
            ll, start = lls[start:start + len(options)], start + len(options)
            lengths = np.array([len(o) for o in options])  # lm-eval: len(str), characters
            for count, scores, slack in ((acc, ll, 2 * tol), (norm, ll / lengths, 2 * tol / lengths.min())):
                tied = np.flatnonzero(scores >= scores.max() - slack)  # what the scorer's argmax may pick
                count += [all(tied == gold), gold in tied]
                certain += len(tied) == 1
        bounds[f"eval/{task.name}/acc"], bounds[f"eval/{task.name}/acc_norm"] = acc / 4, norm / 4
    assert certain >= 6  # of the 8 argmaxes: the data has few near-ties, so the check has teeth
    got = scorer(model)
    assert got.keys() == bounds.keys()
    for name, (low, high) in bounds.items():
        assert low - tols.get(name, 0) <= got[name] <= high + tols.get(name, 0), name


def test_acc_norm_divides_by_the_choices_characters_and_can_flip_the_argmax():
    """Constructed scores: the raw argmax and the length-normalised one differ, and a non-ASCII
    choice ranks by its characters (lm-eval's len(str)), not its UTF-8 bytes."""
    task = tasklib.Task("t", "t.jsonl", tasklib.CHOICE, ("", ""), (("aaaaaaaaaa", "b"), ("éé", "abc")), (0, 1), (1, 2))
    # Example 1: raw -4 < -1 picks "b"; per character -0.4 > -1 picks "aaaaaaaaaa" (gold).
    # Example 2: per character -2.5/2 = -1.25 < -3.3/3 = -1.1 picks "abc" (gold); per byte ("éé" is 4 bytes)
    # -0.625 would pick "éé". Raw -2.5 > -3.3 picks "éé".
    loglik = np.array([-4.0, -1.0, -2.5, -3.3])
    assert tasks.task_metrics(task, loglik, np.ones(4, bool)) == {"eval/t/acc": 0.0, "eval/t/acc_norm": 1.0}
    cloze = tasklib.Task("c", "c.jsonl", tasklib.CLOZE, ("", ""), ((" a",), (" b",)), (0, 0), (1, 2))
    assert tasks.task_metrics(cloze, np.array([-1.0, -2.0]), np.array([True, False])) == {
        "eval/c/acc": 0.5, "eval/c/loglik": -1.5}


# --- in a run ------------------------------------------------------------------------------------

def test_a_bad_task_file_fails_the_run_before_anything_compiles(tmp_path, monkeypatch):
    path = write(tmp_path / "bad.jsonl", [CHOICE_LINES[0], {"context": "x", "choices": ["a"], "gold": 1}])

    def compiled(*args, **kwargs):
        raise AssertionError("init_training ran: the bad file was not refused first")

    monkeypatch.setattr(train_jax, "init_training", compiled)
    with pytest.raises(DataError, match=f"{path}:2: key 'gold'"):
        train_jax.train(compose_config("model.vocab_size=null", f"eval.tasks=[{path}]"), str(tmp_path))


@pytest.mark.slow  # ~6 s: a run's compilations
def test_a_run_logs_task_metrics_on_their_schedule(tmp_path):
    """gpt_tiny, 4 steps, val_freq 2, eval.every 3: tasks at 0 (val_at_start), 3 and max_steps 4."""
    short = [{"context": "ab", "choices": ["c", "dd"], "gold": 0},
             {"context": "x y ", "choices": ["z", "w"], "gold": 1}]
    paths = [write(tmp_path / "mc.jsonl", short), write(tmp_path / "cl.jsonl", CLOZE_LINES)]
    train_jax.train(compose_config("model.vocab_size=null", "train.max_steps=4", "train.val_freq=2",
                                   "train.max_val_steps=1", f"eval.tasks=[{','.join(paths)}]", "eval.every=3"),
                    str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "eval/mc/acc" in r}
    assert sorted(scored) == [0, 3, 4]
    assert [r["step"] for r in records if "val/loss" in r] == [0, 2, 4]
    for r in scored.values():
        assert r["eval/mc/acc"] in (0.0, 0.5, 1.0) and r["eval/mc/acc_norm"] in (0.0, 0.5, 1.0)
        assert r["eval/cl/acc"] in (0.0, 0.5, 1.0) and r["eval/cl/loglik"] < 0
        assert r["time/task_eval_sec"] > 0


SHARDED = """
import json, sys, tempfile, pathlib
sys.path.insert(0, "tests")
import jax, numpy as np
import test_tasks as T
from utils.parallel import layout, mesh as meshlib
run, model = T.setup("gpt")
d = pathlib.Path(tempfile.mkdtemp())
paths = [T.write(d / "c.jsonl", T.CHOICE_LINES), T.write(d / "z.jsonl", T.CLOZE_LINES)]
one = T.tasks.TaskScorer(paths, T.ByteTokenizer(), T.C, 3, T.one_device_mesh(3), "float32")
mesh = meshlib.make_mesh(2, 2, 4)  # rows over data x fsdp; the weights sharded over fsdp, as a run's are
import equinox as eqx, models
params, static = eqx.partition(model, eqx.is_array)
sharded = eqx.combine(jax.device_put(params, layout.state_shardings(mesh, params, params, models.param_axes(model))),
                      static)
four = T.tasks.TaskScorer(paths, T.ByteTokenizer(), T.C, 3, mesh, "float32")
worst = 0.0
for reqs in one.requests:
    a, b = one.scores(model, reqs)[0], four.scores(sharded, reqs)[0]
    for (tokens, n), x, y in zip(reqs, a, b):
        logits = np.asarray(T.forward(model, tokens[None, :-1]))[0, -n:]
        worst = max(worst, abs(x - y) / T.atol(run.model, logits, x, n))
print(json.dumps({"devices": len(jax.devices()), "rows": four.batch_size, "worst": worst}))
"""


@pytest.mark.slow  # ~15 s: a subprocess with 4 CPU devices
def test_rows_split_over_devices_score_as_on_one(tmp_path):
    """A 2x2 (data x fsdp) mesh: batch 3 rounds up to 4 rows, one per device; every request's score
    within its atol of the one-device scorer's."""
    import subprocess
    import sys

    from helpers import REPO, offline_env

    env = {**offline_env(tmp_path), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=4"
    out = subprocess.run([sys.executable, "-c", SHARDED], cwd=REPO, env={**env, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["rows"] == 4
    assert result["worst"] <= 1.0  # every difference within its derived atol (test_tasks.atol)
