"""docs/extending.md's extension examples run: docs/examples.py holds them, each block of the page
is a verbatim copy of it (Lion's of optimizer/lion.py), and every example is registered as the page
says and called: the source yields its documents, the sink writes its file through open_sinks,
the hook adds its norms, the metric comes out of a real compiled step on logging steps only."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTENDING = (ROOT / "docs" / "extending.md").read_text()


def _load_examples():
    spec = importlib.util.spec_from_file_location("eqtrain_docs_examples", ROOT / "docs" / "examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while built
    spec.loader.exec_module(module)
    return module


ex = _load_examples()


def _python_blocks(heading: str) -> list[str]:
    """The ```python blocks of docs/extending.md's section `heading` (up to the next ## heading)."""
    section = EXTENDING.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_extending_examples_are_verbatim_copies():
    headings = ("## A data source", "## A logging sink", "## A periodic job (a hook)", "## A step metric")
    blocks = [block for heading in headings for block in _python_blocks(heading)]
    assert len(blocks) == 5  # source, sink, hook, metric, stateful metric
    examples = (ROOT / "docs" / "examples.py").read_text()
    for block in blocks:
        assert block in examples, f"docs/extending.md block not in docs/examples.py:\n{block}"
    (lion,) = _python_blocks("## An optimizer")
    assert lion in (ROOT / "optimizer" / "lion.py").read_text()
    # the model family's block: docs/example_family.py, which tests/test_model_contract.py runs through
    # every family's matrix (registered as `tiny`)
    (family,) = _python_blocks("## A model family")
    assert family in (ROOT / "docs" / "example_family.py").read_text()


def test_lines_source_registered_gives_its_documents(tmp_path, monkeypatch):
    from loaders import SOURCES, dataset_config
    from utils.errors import ConfigError

    monkeypatch.setitem(SOURCES, "lines", ex.Lines)
    notes = tmp_path / "notes.txt"
    lines = [f"note number {i}\n" for i in range(40)]
    notes.write_text("".join(lines[:20]) + "\n\n" + "".join(lines[20:]))
    d = dataset_config({"name": "lines", "path": str(notes), "val_fraction": 0.25})
    train, val = d.source.documents()
    assert sorted([*train, *val]) == sorted(lines) and len(train) and len(val)  # blank lines dropped
    assert train.fingerprint != val.fingerprint
    with pytest.raises(ConfigError, match=r"^dataset\.path is empty"):
        dataset_config({"name": "lines"})


def test_csv_sink_registered_writes_through_open_sinks(tmp_path, monkeypatch):
    from helpers import compose_config

    from utils.config import to_dict
    from utils.logging.sinks import SINKS, logging_config, open_sinks

    monkeypatch.setitem(SINKS, "csv", ex.Csv)
    node = {**to_dict(compose_config())["logging"], "csv_file": "metrics.csv"}
    sinks = open_sinks(logging_config(node), str(tmp_path), 10, 0, {}, saved={"csv": {}})
    assert "csv" in sinks.named
    sinks.log(1, {"train/loss": 2.5})
    sinks.log(2, {"train/loss": 2.25, "train/lr": 0.001})
    sinks.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert list(csv.reader(f)) == [["1", "train/loss", "2.5"], ["2", "train/loss", "2.25"],
                                       ["2", "train/lr", "0.001"]]
    assert ex.Csv().build(str(tmp_path), 10, 0, {}) is None  # off


def test_weight_norms_hook_adds_per_block_norms():
    from models.gpt import GPT, GPTConfig
    from trainer import hooks as H

    model = GPT(GPTConfig(dim=32, num_heads=2, num_blocks=3, context_length=16, vocab_size=64), jax.random.PRNGKey(0))
    state = SimpleNamespace(model=model)
    ctx = H.LoopContext(start=0, end=300, state=state, data=None)
    hook = ex.WeightNorms()
    ctx.advance(50, state, {})
    assert not hook.due(ctx)
    ctx.advance(100, state, {})
    assert hook.due(ctx)
    H.Hooks([hook]).run(ctx)
    weights = np.asarray(model.blocks.mlp_in.weight_IxO)
    assert ctx.record == pytest.approx({f"weights/mlp_in/{i}": float(np.linalg.norm(weights[i])) for i in range(3)},
                                       rel=1e-6)  # a 32x128 Frobenius norm in float32: ~√4096 roundings ≪ 1e-6


def test_max_update_metric_in_a_compiled_step(tiny_run):
    import train_jax as T
    from trainer import step_metrics
    from utils.parallel import mesh as meshlib

    run = tiny_run("optimizer=sgdm", "optimizer.momentum=0.0", "optimizer.weight_decay=0.0",
                   "train.gradient_clip_val=null")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh, metrics=[step_metrics.FnMetric(step_metrics.loss),
                                                             ex.MAX_UPDATE])
    batch = meshlib.put_batch(np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32),
                              meshlib.batch_sharding(mesh, 1))
    before = [np.array(x) for x in jax.tree.leaves(eqx_params(state.model))]
    state, metrics = step(state, batch, logging=True)
    after = [np.array(x) for x in jax.tree.leaves(eqx_params(state.model))]
    largest = max(float(np.abs(a - b).max()) for a, b in zip(after, before, strict=True))
    # after - before rounds the update by <= EPS32/2 of the largest |weight|
    assert float(metrics["optim/max_abs_update"]) == pytest.approx(
        largest, abs=float(np.finfo(np.float32).eps) * max(float(np.abs(b).max()) for b in before))
    state, metrics = step(state, batch, logging=False)
    assert "optim/max_abs_update" not in metrics and "train/loss" in metrics


def eqx_params(model):
    import equinox as eqx

    return eqx.filter(model, eqx.is_inexact_array)


def test_stateful_loss_ema_metric_keeps_its_state_in_the_train_state(tiny_run):
    """LossEMA's state is carried by the step in metric_states["loss_ema"], and the value it logs is
    the bias-corrected EMA of the losses the step reported (the NumPy recurrence)."""
    import train_jax as T
    from trainer import step_metrics
    from utils.parallel import mesh as meshlib

    run = tiny_run()
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    metric = ex.LossEMA(decay=0.5)
    _, _, state, step = T.init_training(run, mesh, metrics=[step_metrics.FnMetric(step_metrics.loss), metric])
    assert set(state.metric_states) == {"loss_ema"} and int(state.metric_states["loss_ema"]["steps"]) == 0
    rng = np.random.default_rng(0)
    ema, losses, logged = 0.0, [], []
    for _ in range(3):
        batch = meshlib.put_batch(rng.integers(0, 64, (1, 8, 17), dtype=np.int32), meshlib.batch_sharding(mesh, 1))
        state, metrics = step(state, batch, logging=False)  # a stateful metric updates on every step
        losses.append(float(metrics["train/loss"]))
        logged.append(float(metrics["train/loss_ema"]))
    for t, loss in enumerate(losses, start=1):
        ema = 0.5 * ema + 0.5 * loss
        # a 2-term float32 recurrence and one division: a few EPS32 of the loss
        assert logged[t - 1] == pytest.approx(ema / (1 - 0.5 ** t), rel=8 * float(np.finfo(np.float32).eps))
    assert int(state.metric_states["loss_ema"]["steps"]) == 3
