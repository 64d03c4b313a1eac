"""scripts/plot_runs.py on small fake run directories (no training): a two-job sweep gives valid
PNGs, labels keep only the overrides that differ, a resumed run's repeated steps are merged (later
values win), the tokens axis comes from data/tokens or the config, and bad input exits 2 with one line.

Everything runs in-process through the script's functions and `main(argv)`; one subprocess checks
the command exactly as a user types it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
plot_runs = load_script("plot_runs")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMON = ["model.dim=32", "dataset.batch_size=8", "train.max_steps=30"]
# tokens per step: total_batch_size 16 (batch_size 8, accumulation 2) x model.context_length 32
CONFIG = {"model": {"dim": 32, "context_length": 32}, "dataset": {"batch_size": 8, "total_batch_size": 16,
                                                                   "context_length": None},
          "optimizer": {"name": "adamw", "lr_config": {"name": "cosine", "lr": 0.003}}}


def records(steps=range(0, 31, 10), loss0: float = 5.0, **extra) -> list[dict]:
    """Metrics lines as train_jax.py logs them: val/loss only on eval steps (0 and 30 here)."""
    out = []
    for s in steps:
        r = {"step": s}
        if s:
            r.update({"train/loss": loss0 - 0.05 * s, "train/lr": 1e-3, "train/grad_norm": 1.0 + 0.01 * s,
                      "params/norm": 10.0 + s, "grads/cos(gn, g(n-1))": 0.1})
            r.update({k: f(s) for k, f in extra.items()})
        if s % 30 == 0:
            r["val/loss"] = loss0 - 0.04 * s
        out.append(r)
    return out


def make_run(path: Path, overrides: list[str], lines: list[dict], config: dict | None = None,
             choices: dict | None = None) -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config or CONFIG))
    if choices is not None:
        (path / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    return path


@pytest.fixture
def sweep(tmp_path) -> Path:
    """multirun/<date>/<time>/ with jobs 0 (adamw) and 1 (sgdm), as `-m optimizer=adamw,sgdm` leaves it."""
    root = tmp_path / "multirun" / "2026-11-30" / "10-00-00"
    make_run(root / "0", COMMON + ["optimizer=adamw"], records())
    make_run(root / "1", COMMON + ["optimizer=sgdm"], records(loss0=5.5))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path


def test_sweep_gives_pngs(sweep, capsys):
    assert plot_runs.main([str(sweep), "--metric", "grads/cos(gn, g(n-1))", "--metric", "params/norm"]) == 0
    out, err = capsys.readouterr()
    names = ["loss_vs_step", "loss_vs_tokens", "lr", "grad_norm", "grads_cos_gn_g_n-1", "params_norm"]
    assert out.split() == [str(sweep / f"{n}.png") for n in names]  # printed: the paths written, in order
    for n in names:
        assert_png(sweep / f"{n}.png")
    # no run logged time/elapsed_sec: skipped with one note, not an error
    assert not (sweep / "loss_vs_time.png").exists()
    assert err.strip() == "note: skipped loss_vs_time.png: no run logged time/elapsed_sec"


def test_time_axis_and_run_dir_arguments(tmp_path, capsys):
    """Two run dirs given one by one; the wall-time plot appears once a run logs time/elapsed_sec,
    and a run that did not is left out of it with a note."""
    a = make_run(tmp_path / "outputs" / "2026-11-30" / "10-00-00", ["optimizer=adamw"],
                 records(**{"time/elapsed_sec": lambda s: 2.0 * s}))
    b = make_run(tmp_path / "outputs" / "2026-11-30" / "11-00-00", ["optimizer=sgdm"], records())
    written = plot_runs.plot([plot_runs.load_run(str(a)), plot_runs.load_run(str(b))], str(tmp_path / "plots"))
    assert [Path(p).name for p in written] == ["loss_vs_step.png", "loss_vs_tokens.png", "loss_vs_time.png",
                                               "lr.png", "grad_norm.png"]
    assert "left out optimizer=sgdm" in capsys.readouterr().err
    # val/loss at step 0 (an evaluation-only record, no elapsed time) is dropped, not placed at 0 s
    xs, ys = plot_runs.series(plot_runs.load_run(str(a)), "val/loss", "time")
    assert xs.tolist() == [60.0] and ys.tolist() == [pytest.approx(5.0 - 0.04 * 30)]


def test_labels_show_only_differing_overrides(tmp_path):
    runs = []
    for i, (opt, lr) in enumerate([("adamw", "1e-3"), ("adamw", "3e-4"), ("sgdm", "1e-3"), ("sgdm", "3e-4")]):
        runs.append(plot_runs.load_run(str(make_run(tmp_path / "m" / str(i),
                    COMMON + [f"optimizer={opt}", f"optimizer.lr_config.lr={lr}"], records()))))
    assert plot_runs.labels(runs) == ["optimizer=adamw lr=1e-3", "optimizer=adamw lr=3e-4",
                                      "optimizer=sgdm lr=1e-3", "optimizer=sgdm lr=3e-4"]
    # a run that did not set a differing key: its value comes from Hydra's choices or its config,
    # and the same lr written two ways (3e-3 vs the config's 0.003) does not differ
    d = tmp_path / "d"
    muon = make_run(d / "a", ["optimizer=muon", "optimizer.lr_config.lr=3e-3", "optimizer/lr_config=linear"],
                    records())
    plain = make_run(d / "b", [], records(), choices={"optimizer": "adamw", "optimizer/lr_config": "cosine"})
    assert plot_runs.labels([plot_runs.load_run(str(muon)), plot_runs.load_run(str(plain))]) == [
        "optimizer=muon lr_config=linear", "optimizer=adamw lr_config=cosine"]
    # keys that would shorten to the same tail keep enough of their path to differ
    e = tmp_path / "e"
    x = make_run(e / "a", ["optimizer.lr_config.lr=1", "optimizer.groups.hidden.lr=2"], records())
    y = make_run(e / "b", ["optimizer.lr_config.lr=3", "optimizer.groups.hidden.lr=4"], records())
    assert plot_runs.labels([plot_runs.load_run(str(x)), plot_runs.load_run(str(y))]) == [
        "lr_config.lr=1 hidden.lr=2", "lr_config.lr=3 hidden.lr=4"]


def test_labels_fall_back_to_directory_names(tmp_path):
    a = make_run(tmp_path / "outputs" / "2026-11-30" / "10-00-00", COMMON, records())
    b = make_run(tmp_path / "outputs" / "2026-11-30" / "11-00-00", COMMON, records())
    job = make_run(tmp_path / "multirun" / "2026-11-30" / "12-00-00" / "0", COMMON, records())
    load = plot_runs.load_run
    assert plot_runs.labels([load(str(a))]) == ["10-00-00"]  # a single run
    assert plot_runs.labels([load(str(a)), load(str(b))]) == ["10-00-00", "11-00-00"]  # same overrides
    assert plot_runs.labels([load(str(job))]) == ["12-00-00/0"]  # a job's bare number says little


def test_resumed_run_keeps_last_record_of_a_step(tmp_path):
    first = records(range(0, 31, 10))  # the first segment got to step 30, its checkpoint was at 10
    second = [dict(r, **{"train/loss": 1.0 + r["step"] / 100}) for r in records(range(20, 41, 10))]
    run = make_run(tmp_path / "run", [], first + second)
    loaded = plot_runs.load_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in loaded] == [0, 10, 20, 30, 40]
    assert [r.get("train/loss") for r in loaded] == [None, 4.5, 1.2, 1.3, 1.4]


def test_resume_boundary_keeps_the_previous_segments_losses(tmp_path):
    """A resumed segment's first record, at the step it resumed from, holds only its start-up metrics
    (train_jax logs optim/state_bytes and data/... there): the losses the previous segment logged at
    that step stay on the curves. (Keeping the last record per step dropped them: step 30 vanished
    from train/loss and val/loss.)"""
    first = records(range(0, 31, 10))  # saved at 30, then stopped
    start = {"step": 30, "optim/state_bytes": 4096, "data/fingerprint": "0123abcd", "data/epoch": 0}
    run = make_run(tmp_path / "run", [], first + [start] + records(range(40, 61, 10), loss0=4.9))
    loaded = plot_runs.load_run(str(run))
    assert [r["step"] for r in loaded.records] == [0, 10, 20, 30, 40, 50, 60]
    assert loaded.records[3] == {**first[3], **start}  # merged: both segments' metrics at step 30
    xs, ys = plot_runs.series(loaded, "train/loss")
    assert xs.tolist() == [10, 20, 30, 40, 50, 60]
    assert ys.tolist() == pytest.approx([4.5, 4.0, 3.5, 2.9, 2.4, 1.9])
    assert plot_runs.series(loaded, "val/loss")[0].tolist() == [0, 30, 60]


def test_tokens_axis(tmp_path):
    assert plot_runs.tokens_per_step(CONFIG) == 16 * 32
    no_total = {"model": {"context_length": 128}, "dataset": {"batch_size": 8, "total_batch_size": None,
                                                              "context_length": 64}}
    assert plot_runs.tokens_per_step(no_total) == 8 * 64  # batch_size, and the dataset's shorter window
    # derived from the config: step x tokens per step
    run = plot_runs.load_run(str(make_run(tmp_path / "cfg", [], records())))
    xs, _ = plot_runs.series(run, "train/loss", "tokens")
    assert xs.tolist() == [10 * 512, 20 * 512, 30 * 512]
    # data/tokens wins where logged; records without it (step 0's evaluation) are interpolated
    run = plot_runs.load_run(str(make_run(tmp_path / "logged", [], records(**{"data/tokens": lambda s: 100.0 * s}),
                                          config={"model": {}})))
    assert plot_runs.series(run, "train/loss", "tokens")[0].tolist() == [1000.0, 2000.0, 3000.0]
    assert plot_runs.series(run, "val/loss", "tokens")[0].tolist() == [0.0, 3000.0]


def test_safe_names():
    assert plot_runs.safe_name("grads/cos(gn, g(n-1))") == "grads_cos_gn_g_n-1"
    assert plot_runs.safe_name("train/loss") == "train_loss"
    assert plot_runs.safe_name("../x y") == "x_y"  # never a hidden file or a path out of --out


@pytest.mark.parametrize("case", ["missing_metric", "bad_json", "no_run", "no_path"])
def test_bad_input_exits_2_with_one_line(sweep, tmp_path, capsys, case):
    argv, expected = [str(sweep)], None
    if case == "missing_metric":
        argv += ["--metric", "params/nrom"]
        expected = "error: --metric 'params/nrom': no run logged it; they log params/norm"  # closest first
    elif case == "bad_json":
        with open(sweep / "1" / "metrics.jsonl", "a") as f:
            f.write('{"step": 40, "train/loss": \n')
        expected = f"error: {sweep / '1' / 'metrics.jsonl'}:5: not a JSON line"
    elif case == "no_run":
        (tmp_path / "empty" / "sub").mkdir(parents=True)
        argv = [str(tmp_path / "empty")]
        expected = f"error: {tmp_path / 'empty'}: no run directory there"
    else:
        argv = [str(tmp_path / "nope")]
        expected = f"error: {tmp_path / 'nope'}: no such file or directory"
    assert plot_runs.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(expected) and err.count("\n") == 1 and not out, err
    assert not list(sweep.glob("*.png"))  # checked before anything is written


def test_relative_paths_as_typed(sweep, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert plot_runs.main(["multirun/2026-11-30/10-00-00/0", "multirun/2026-11-30/10-00-00/1",
                           "--out", "plots", "--metric", "params/norm"]) == 0
    printed = capsys.readouterr().out.split()
    assert "plots/params_norm.png" in printed and "plots/loss_vs_step.png" in printed  # as the user would type them
    for p in printed:
        assert_png(tmp_path / p)


def test_script_runs_as_the_user_types_it(sweep):
    """The one subprocess: `python scripts/plot_runs.py SWEEP --metric ...` from the repository root."""
    proc = subprocess.run([sys.executable, "scripts/plot_runs.py", str(sweep), "--metric", "grads/cos(gn, g(n-1))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert str(sweep / "grads_cos_gn_g_n-1.png") in proc.stdout.split("\n")
    assert_png(sweep / "grads_cos_gn_g_n-1.png")
    assert_png(sweep / "loss_vs_step.png")
    assert "loss_vs_time.png" in proc.stderr  # the note on the skipped plot
