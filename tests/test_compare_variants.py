"""Variants of a comparison (`variants.<label>="<optimizer> <run overrides>"`, issue 38 §3): an
optimizer plus fixed overrides (here weight averaging) compared as an entry of its own.

- the plan: the variant's runs train its optimizer with its overrides, under its label, on its own
  lr grid centred on its optimizer's yaml lr; lr.grid/sweep/baseline name it; compare.json records it,
  and a directory planned before variants existed continues;
- refusals are one ConfigError line naming the knob;
- a tiny in-process comparison (adamw vs adamw_ema): the variant's runs get the override (read from
  the config each run trained with), its branch equals a plain run from scratch with the same
  overrides bit for bit, its results are the average's val/loss, and the report has both rows.
"""

import csv
import json

import pytest
from helpers import TINY_OVERRIDES

import train_jax as T
from compare import launch
from compare.plan import base_lrs, compare_config, make_plan, start_values, workload_lrs
from compare.report import build_report
from utils.config import compose_overrides
from utils.errors import ConfigError

EMA = ("train.weight_average=ema", "train.weight_average_half_life=5")
VARIANT = {"adamw_ema": "adamw " + " ".join(EMA)}
KNOBS = {"optimizers": ["adamw"], "budgets": [10, 20], "lr": {"points": 1}, "seeds": 1, "warmup": 2,
         "variants": VARIANT}
RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
    "logging.log_every=1", "train.max_val_steps=2")
LRS = {"adamw": 3e-3, "adamw_ema": 3e-3}  # adamw's yaml lr (base_lrs reads it: test below)


def plan(knobs=KNOBS, run=RUN, lrs=LRS):
    return make_plan(compare_config(knobs), run, lrs)


def test_a_variant_is_an_entry_training_its_optimizer_with_its_overrides():
    k = compare_config({**KNOBS, "lr": {"points": 2}})
    assert k.optimizers == ("adamw", "adamw_ema") and k.optimizer_of("adamw_ema") == "adamw"
    lrs = base_lrs(k.optimizers, RUN, k.variants)
    assert lrs["adamw_ema"] == lrs["adamw"] == base_lrs(("adamw",), RUN)["adamw"]  # centred on adamw's yaml lr
    p = make_plan(k, RUN, lrs)
    mine = [r for r in p.runs if r.optimizer == "adamw_ema"]
    plain = [r for r in p.runs if r.optimizer == "adamw"]
    assert len(mine) == len(plain) == 6 and all(r.id.startswith("default__adamw_ema__lr") for r in mine)
    assert {r.lr for r in mine} == {r.lr for r in plain}
    for r in mine:
        assert "optimizer=adamw" in r.overrides and set(EMA) <= set(r.overrides)
    for r in plain:
        assert not any(o.startswith("train.weight_average") for o in r.overrides)
    # the variant's runs are the plain ones plus its overrides, nothing else
    for a, b in zip(plain, mine):
        assert [o for o in b.overrides if o not in EMA] == list(a.overrides)
    assert p.to_json()["knobs"]["variants"] == {"adamw_ema": ["adamw", *EMA]}
    assert start_values(k, RUN)[("default", "adamw_ema")]["lr"] == lrs["adamw"]


def test_a_variants_label_takes_lr_grid_sweep_workload_lr_and_baseline():
    k = compare_config({**KNOBS, "lr": {"points": 2, "grid": {"adamw_ema": [1e-3, 2e-3]}},
                        "sweep": {"adamw_ema": {"weight_decay": [0.0, 0.1]}}, "baseline": "adamw_ema"})
    assert k.baseline == "adamw_ema" and k.sweep_of("adamw_ema") == (("weight_decay", (0.0, 0.1)),)
    assert k.sweep_of("adamw") == ()
    p = make_plan(k, RUN, LRS)
    mine = [r for r in p.runs if r.optimizer == "adamw_ema"]
    assert {r.lr for r in mine} == {1e-3, 2e-3} and len(mine) == 2 * 2 * 3
    assert {o for r in mine for o in r.overrides if o.startswith("optimizer.weight_decay")} == {
        "optimizer.weight_decay=0", "optimizer.weight_decay=0.1"}
    k = compare_config({**KNOBS, "workloads": {"w": "lr.adamw_ema=5e-3"}})
    lrs = workload_lrs(k, RUN)
    assert lrs == {"w": {"adamw": LRS["adamw"], "adamw_ema": 5e-3}}
    assert {r.lr for r in make_plan(k, RUN, lrs).runs if r.optimizer == "adamw_ema"} == {5e-3}


def test_a_directory_planned_before_variants_continues_and_grows_by_one(tmp_path):
    """compare.json written before the knob (no `variants` key): the same command continues it; adding a
    variant adds its runs beside the others (as adding an optimizer does); changing a variant's
    overrides would change the runs made, and is refused."""
    p = plan({k: v for k, v in KNOBS.items() if k != "variants"})
    old = p.to_json()
    del old["knobs"]["variants"]
    (tmp_path / "compare.json").write_text(json.dumps(old))
    launch.open_dir(p, str(tmp_path))  # no refusal
    launch.open_dir(plan(), str(tmp_path))  # grows by the variant's runs
    assert len(json.loads((tmp_path / "compare.json").read_text())["runs"]) == 6
    changed = plan({**KNOBS, "variants": {"adamw_ema": "adamw " + EMA[0]}})
    with pytest.raises(ConfigError, match="holds another comparison .its runs differ"):
        launch.open_dir(changed, str(tmp_path))


@pytest.mark.parametrize("change, run, words", [
    ({"variants": {"adamw": "adamw " + EMA[0]}}, RUN, "variants.adamw: 'adamw' is an optimizer's name"),
    ({"variants": {"ema": "adamz " + EMA[0]}}, RUN, "variants.ema: unknown optimizer 'adamz'"),
    ({"variants": {"ema": "adamw optimizer.lr_config.lr=1"}}, RUN, "comparison sets optimizer.lr_config"),
    ({"variants": {"ema": "adamw random_seed=3"}}, RUN, "in variants.ema.*comparison sets random_seed"),
    ({"variants": {"ema": EMA[0]}}, RUN, "unknown optimizer 'train.weight_average=ema'"),
    ({"variants": {"ema": "adamw notanoverride"}}, RUN, "variants.ema=.*must be an optimizer then run overrides"),
    ({"variants": {"a__b": "adamw " + EMA[0]}}, RUN, "variants.a__b: a variant's label"),
    ({"variants": {"ema": "adamw train.weight_average=tail"}}, RUN, "tail averaging's window"),
    ({"variants": {"ema": "adamw optimizer.weight_decay=0"}, "sweep": {"weight_decay": [0.0, 0.1]}}, RUN,
     "variants.ema fixes optimizer.weight_decay, which sweep.weight_decay"),
    ({"variants": {"ema": "adamw train.val_freq=4"}, "val_every": 2}, RUN, "variants.ema sets train.val_freq"),
    ({"variants": {"ema": "adamw model.dim=64"}}, RUN, "variants.ema sets model.dim, which the run overrides"),
    ({"variants": {"ema": "adamw train.grad_clip=1"}, "workloads": {"w": "train.grad_clip=2"}}, RUN,
     "variants.ema sets train.grad_clip, which workloads.w also set"),
    ({"variants": {}}, (*RUN, "train.weight_average=tail"), "train.weight_average=tail .for adamw.: tail"),
])
def test_bad_variants_are_one_line_config_errors(change, run, words):
    with pytest.raises(ConfigError, match=words) as e:
        k = compare_config({**KNOBS, **change})
        make_plan(k, run, {o: 3e-3 for o in k.optimizers} if not k.workloads[0][0] == "w" else
                  {"w": {o: 3e-3 for o in k.optimizers}})
    assert "\n" not in str(e.value)


def test_the_report_resolves_a_variants_optimizer_and_says_its_ranking_is_the_averages():
    """section_special reads a variant's optimizer class through entry_of (Schedule-Free's: no cooldown);
    section_variants names each variant and every averaging entry, from compare.json and run.json alone."""
    from compare.report import Run, section_special, section_variants

    def run(entry, overrides):
        return Run({"id": entry, "optimizer": entry, "overrides": list(overrides)}, [])

    variants = {"sf_ema": ["schedule_free_adamw", "train.grad_clip=0.5"], "adamw_ema": ["adamw", *EMA],
                "unused": ["adamw", EMA[0]]}
    runs = {r.id: r for r in (run("adamw", ["optimizer=adamw"]), run("sf_ema", ["optimizer=schedule_free_adamw"]),
                              run("adamw_ema", ["optimizer=adamw", *EMA]))}
    special = section_special(runs, variants)
    assert "- sf_ema needs no cooldown (its averaging replaces the lr decay)" in "\n".join(special)
    assert not any(line.startswith(("- adamw ", "- adamw_ema ")) for line in special)
    lines = section_variants(runs, variants)
    assert lines[2:5] == [
        "- adamw_ema is adamw with `train.weight_average=ema` `train.weight_average_half_life=5`: an entry of its "
        "own (its own lr grid, centred on its optimizer's yaml lr).",
        "- sf_ema is schedule_free_adamw with `train.grad_clip=0.5`: an entry of its own (its own lr grid, centred "
        "on its optimizer's yaml lr).",
        "- adamw_ema averages its weights (train.weight_average=ema): its val/loss, and so every result and ranking "
        "of it below, is the average's, what its runs evaluate and export; its trained weights' is val/loss_raw in "
        "its metrics.jsonl."]
    assert len(lines) == 6 and section_variants({"a": run("adamw", [])}, {}) == []  # no variant, no averaging


def test_the_cli_passes_a_variant_as_one_shell_word():
    from helpers import load_script

    script = load_script("compare")
    ours, theirs, _ = script.split_argv(["optimizers=[adamw]", "variants.adamw_ema=adamw " + " ".join(EMA),
                                         "model.dim=32"])
    assert theirs == ["model.dim=32"]
    assert compare_config(script.compose_knobs(ours)).variants == (("adamw_ema", "adamw", EMA),)


@pytest.mark.slow  # 6 tiny runs and a 20-step run from scratch: 33 s measured on 2 shared cores
def test_a_variant_comparison_trains_the_averaged_runs_and_reports_both(tmp_path):
    trained = {}

    def train(cfg, run_dir):  # the config each run trains with, as it reads it
        trained[run_dir.rsplit("/", 1)[-1]] = (cfg.optimizer.name, cfg.train.weight_average,
                                                float(cfg.train.weight_average_half_life))
        T.train(cfg, run_dir)

    p = plan()
    summary = launch.run_plan(p, str(tmp_path / "c"), train=train, say=lambda _: None)
    assert len(summary.done) == 6 and not summary.failed
    for run in p.runs:
        assert trained[run.id] == ("adamw", "ema" if run.optimizer == "adamw_ema" else "none",
                                   5.0 if run.optimizer == "adamw_ema" else 100.0), run.id
    # the variant's S20 branch equals a plain run from scratch with the same overrides, bit for bit:
    # every step's train/loss and val/loss (the average's), and val/loss_raw (the trained weights')
    run_id = "default__adamw_ema__lr0.003__seed0__S20"
    branch = json.loads((tmp_path / "c" / "runs" / run_id / "run.json").read_text())
    overrides = [o for o in branch["overrides"] if not o.startswith(("checkpoint.", "train.val_at="))]
    (tmp_path / "scratch").mkdir()
    T.train(compose_overrides([*overrides, "train.val_at=[8,16,20]"], job_name="test"), str(tmp_path / "scratch"))
    scratch, cooled = curves(tmp_path / "scratch"), curves(tmp_path / "c" / "runs" / run_id)
    trunk = curves(tmp_path / "c" / "runs" / run_id.replace("__S20", "__trunk"))
    assert {**{s: v for s, v in trunk.items() if s <= 16}, **{s: v for s, v in cooled.items() if s > 16}} == scratch
    # the average is not the trained weights: val/loss (what ranks the variant) is the average's
    assert cooled[20]["val/loss"] != cooled[20]["val/loss_raw"]
    md = open(build_report(str(tmp_path / "c"))).read()
    with open(tmp_path / "c" / "results.csv") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    assert float(rows[run_id]["final_val_loss"]) == cooled[20]["val/loss"]  # float repr round-trips
    assert {r["optimizer"] for r in rows.values()} == {"adamw", "adamw_ema"}
    assert "- adamw_ema is adamw with `train.weight_average=ema` `train.weight_average_half_life=5`" in md
    assert "- adamw_ema averages its weights (train.weight_average=ema): its val/loss" in md
    summary_json = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert "adamw_ema" in json.dumps(summary_json) and "adamw" in json.dumps(summary_json)
    table = [line for line in md.splitlines() if line.startswith("| adamw")]
    assert any(line.startswith("| adamw_ema |") for line in table) and any(line.startswith("| adamw |")
                                                                              for line in table)


def curves(run_dir) -> dict[int, dict[str, float]]:
    """step -> {train/loss, val/loss, val/loss_raw} from a run's metrics.jsonl (the last record of a step wins)."""
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            out.setdefault(record["step"], {}).update(
                {k: record[k] for k in ("train/loss", "val/loss", "val/loss_raw") if k in record})
    return {step: values for step, values in out.items() if values}
