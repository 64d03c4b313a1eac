"""The point a run evaluates (optimizer.eval_params): Schedule-Free trains y and must be evaluated,
sampled, ranked for the best checkpoint and exported at its average x = (y − (1 − b1)·z)/b1. One
tiny Schedule-Free run, then x recomputed here from the checkpoint's y and z; and the loop's
hooks against fakes (no model)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import EPS32, compose_config, load_script
from optax.contrib import ScheduleFreeState
from safetensors.numpy import load_file

import train_jax as T
from trainer import hooks as H
from utils.checkpoint.storage import EVAL_MODEL, complete_steps, leaf_name, open_checkpoint
from utils.config import validate
from utils.logging.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
# A high lr so y and x are far apart after 6 steps; no remat and an unrolled loop compile faster.
RUN = ("model.vocab_size=null", "train.sample_tokens=0", f"train.max_steps={STEPS}", "train.val_freq=3",
       "train.max_val_steps=2", "model.context_length=32", "model.remat=none", "model.scan_blocks=false",
       "optimizer=schedule_free_adamw", "optimizer.lr_config.lr=1e-2", "optimizer.lr_config.warmup=2",
       "optimizer.weight_decay=0.1", "optimizer.groups.embed.b1=0.8", "checkpoint.save=true",
       "checkpoint.save_path=ck", "checkpoint.keep_best=true", "dataset=text_files", "dataset.val_fraction=0.2",
       "dataset.paths=[corpus.jsonl]")


# --- the loop's hooks ask the context for the model to evaluate ------------------------------------


def test_evaluation_and_samples_use_the_eval_view_once_per_step():
    views = []

    def view(state):
        views.append(state.step)
        return f"x{state.step}"

    got = []
    evaluation = H.Evaluation(lambda model: got.append(("eval", model)) or {"val/loss": 1.0}, 1, 3, False)
    samples = H.EvalSamples(lambda model, prompt, n: got.append(("samples", model)) or "", ["p"], 1,
                            SimpleNamespace(log_samples=lambda step, pairs: None))
    sample = H.Sample(lambda model, prompt, n: got.append(("sample", model)) or "", "p", 1)
    ctx = H.LoopContext(0, 2, state=SimpleNamespace(step=0, model="y0"), data=None, eval_view=view)
    hooks = H.Hooks([evaluation, samples, sample])
    for step in (1, 2):
        ctx.advance(step, SimpleNamespace(step=step, model=f"y{step}"), {})
        hooks.run(ctx)
    assert got == [("eval", "x1"), ("samples", "x1"), ("eval", "x2"), ("samples", "x2"), ("sample", "x2")]
    assert views == [1, 2]  # computed once per step, for every hook that asks
    plain = H.LoopContext(0, 1, state=SimpleNamespace(model="y"), data=None)
    assert plain.eval_model() == "y"  # no view: the state's own model


# --- a Schedule-Free run -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sf_run(tmp_path_factory, _cache_dir) -> Path:
    """The run's directory, holding corpus.jsonl, ck/ and run/metrics.jsonl."""
    tmp = tmp_path_factory.mktemp("sf")
    lines = [line for f in sorted((ROOT / "models").glob("*.py")) for line in f.read_text().splitlines()
             if line.strip()]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 8])}) + "\n"
                                              for i in range(0, len(lines), 8)))
    with pytest.MonkeyPatch.context() as mp:  # _offline_env is per test; a module fixture needs its own
        mp.setenv("EQTRAIN_CACHE", str(_cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.chdir(tmp)
        (tmp / "run").mkdir()
        T.train(compose_config(*RUN), str(tmp / "run"))
    return tmp


def _x_by_hand(model, opt_state) -> tuple[list, list]:
    """([x of every array leaf, float32], [its bound: 2 roundings of max(|y|, |z|)/b1]) in the
    model's leaf order, from each group's ScheduleFreeState in the known layout of make_optimizer's
    state (clip, PartitionState) -> MaskedState; float64 arithmetic."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    xs, bounds = [None] * len(leaves), [None] * len(leaves)
    for group, masked in opt_state[1].inner_states.items():
        sf = masked.inner_state
        assert isinstance(sf, ScheduleFreeState), group
        b1 = float(sf.b1)
        zs = jax.tree.leaves(sf.z, is_leaf=lambda z: z.__class__.__name__ == "MaskedNode")
        for i, (y, z) in enumerate(zip(leaves, zs, strict=True)):
            if hasattr(z, "shape"):
                y64, z64 = np.asarray(y, np.float64), np.asarray(z, np.float64)
                xs[i] = ((y64 - (1 - b1) * z64) / b1).astype(np.float32)
                bounds[i] = 2 * EPS32 * np.maximum(np.abs(y64), np.abs(z64)) / b1
    assert all(x is not None for x in xs)  # every leaf belongs to one group
    return xs, bounds


@pytest.fixture(scope="module")
def restored(sf_run):
    """(trainer restored from the last checkpoint: its y and optimizer state, x by hand, bounds)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sf_run)
        source = open_checkpoint(str(sf_run / "ck"), "latest", with_opt_state=True)
        trainer = T.build_trainer(validate(source.config), source)
    xs, bounds = _x_by_hand(trainer.state.model, trainer.state.opt_state)
    return trainer, xs, bounds


def test_validation_loss_is_the_loss_at_x_not_at_y(sf_run, restored):
    """The logged val/loss at the last step is the loss of x, the run's eval view of the restored
    state, bit for bit; that x is x by hand within `_x_by_hand`'s bound; y's loss differs."""
    trainer, xs, bounds = restored
    logged = {r["step"]: r for r in read_metrics(str(sf_run / "run" / "metrics.jsonl"))}[STEPS]["val/loss"]
    y_model = trainer.state.model
    x_model = trainer.eval_view(trainer.state)
    for x, by_hand, bound in zip(jax.tree.leaves(eqx.filter(x_model, eqx.is_array)), xs, bounds, strict=True):
        np.testing.assert_array_less(np.abs(np.asarray(x) - by_hand), bound + 1e-30)
    at_x, at_y = trainer.evaluate(x_model)["val/loss"], trainer.evaluate(y_model)["val/loss"]
    # Bit for bit: the checkpoint restores the run's y and z exactly, the eval view is the same jitted
    # program on them (the run's x), and evaluate the same programs (same HLO, this process's XLA, the
    # tests' flags) on the same windows. (x by hand instead moves the loss by up to 2 roundings of
    # every weight: a bound that needs the loss's gradient.)
    assert logged == at_x
    assert abs(at_y - at_x) > 1e-3 * at_x, (at_x, at_y)  # far apart: y is not x


def test_checkpoints_and_exports_hold_x_beside_y(sf_run, restored, tmp_path):
    """`model` keeps y (what training resumes from), `eval_model` x (what export and sampling read),
    within the bound of `_x_by_hand`; the best checkpoint (ranked by x's val/loss) has both too."""
    trainer, xs, bounds = restored
    ys = jax.tree.leaves(eqx.filter(trainer.state.model, eqx.is_array))
    out = tmp_path / "out"
    assert load_script("export_model").main([str(sf_run / "ck"), "--out", str(out)]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    paths = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(eqx.filter(trainer.state.model,
                                                                                      eqx.is_array))[0]]
    far = 0
    for name, x, y, bound in zip(paths, xs, ys, bounds, strict=True):
        np.testing.assert_array_less(np.abs(tensors[name] - x), bound + 1e-30, err_msg=name)
        far += np.any(np.abs(np.asarray(y) - x) > 10 * bound)
    assert far == len(paths)  # y and x apart in every leaf: the bound tells them apart
    best = sf_run / "ck" / "best"
    assert complete_steps(str(best)) and os.path.isdir(best / f"iter_{complete_steps(str(best))[-1]}" / EVAL_MODEL)
