"""optimizer/renames.py: every optimizer's knobs follow one vocabulary (issue 36), and the old names
keep working, with one warning line each, wherever a config enters: the command line (before
Hydra, which refuses a key the yaml lacks), a script's composed overrides, and a saved config dict
(a checkpoint's). Every case is derived from the table, so a rename added there is tested at once.
The end-to-end resume of a checkpoint saved with old names is test_checkpoint.py's
test_resume_is_bit_identical (its soap and shampoo cases); a comparison directory with old names,
test_a_comparison_planned_with_old_names_continues below."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from helpers import TINY_OVERRIDES, compose_config, load_script, with_old_names

from compare import launch
from compare.launch import old_knob_names
from compare.plan import compare_config, make_plan
from optimizer import OPTIMIZERS
from optimizer.renames import FILLS, RENAMES, rename_optimizer, renamed_pairs
from trainer.resume import merge_config
from utils.checkpoint.storage import CheckpointConfig, Source
from utils.config import renamed_overrides, to_dict, validate
from utils.errors import ConfigError

# a comparison's run overrides: the tiny run less the knobs it sets itself (as tests/test_compare.py's)
RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size")))
PAIRS = [(opt, group, old, new) for opt in sorted(RENAMES) for group, old, new in renamed_pairs(opt)]
PAIR_IDS = [f"{opt}.{'groups.' + group + '.' if group else ''}{old}" for opt, group, old, _ in PAIRS]


def a_value(optimizer: str, knob: str):
    """A valid value of `knob` other than its default: an int +1, a float (or null) halved."""
    default = {f.name: f.default for f in dataclasses.fields(OPTIMIZERS[optimizer])}[knob]
    if isinstance(default, int) and not isinstance(default, bool):
        return default + 1
    return (default or 1.0) / 2


def a_group(optimizer: str, knob: str, group: str | None) -> str | None:
    """A parameter group whose overrides take `knob` (the rename's own group when it names one)."""
    hparams = OPTIMIZERS[optimizer]()
    return group or next((g for g in ("hidden", "embed", "head", "scalar") if knob in hparams.group_knobs(g)), None)


def test_the_table_names_real_knobs_of_registered_optimizers():
    """Every new name is a knob of its optimizer and no old name still is (else the rename would hide it)."""
    for opt, group, old, new in PAIRS:
        fields = {f.name for f in dataclasses.fields(OPTIMIZERS[opt])}
        assert new in fields, (opt, new)
        assert group is not None or old not in fields, (opt, old)
    for opt, fills in FILLS.items():
        fields = {f.name for f in dataclasses.fields(OPTIMIZERS[opt])}
        assert set(fills) <= fields and set(fills.values()) <= fields


@pytest.mark.parametrize(("opt", "group", "old", "new"), PAIRS, ids=PAIR_IDS)
def test_old_and_new_names_on_the_command_line_reach_the_same_field(opt, group, old, new):
    """`optimizer.<old>=v` and `optimizer.<new>=v` (and the group override, `++` as a sweep may
    write it) validate to the same dataclass field; the old one warns once, naming both."""
    value = a_value(opt, new)
    lines = []
    runs = {}
    if group is None:
        for knob in (old, new):
            overrides = renamed_overrides([f"optimizer={opt}", f"optimizer.{knob}={value}"], lines.append)
            runs[knob] = validate(compose_config(*overrides))
            assert getattr(runs[knob].optimizer.hparams, new) == value
        assert runs[old].optimizer.hparams == runs[new].optimizer.hparams
    where = a_group(opt, new, group)
    if where is not None:
        for knob in (old, new):
            overrides = renamed_overrides([f"optimizer={opt}", f"++optimizer.groups.{where}.{knob}={value}"],
                                          lines.append)
            assert validate(compose_config(*overrides)).optimizer.group_overrides[where] == {new: value}
    stem = f"optimizer.groups.{where}." if group else "optimizer."
    assert f"optimizer={opt}: `{stem}{old}` is now `{stem}{new}`" in lines[0]
    assert len(lines) == (1 if group is None else 0) + (1 if where is not None else 0)


@pytest.mark.parametrize(("opt", "group", "old", "new"), PAIRS, ids=PAIR_IDS)
def test_giving_both_names_is_refused(opt, group, old, new):
    stem = f"optimizer.groups.{group}." if group else "optimizer."
    with pytest.raises(ConfigError, match=rf"^{stem}{old} \(an old name\) and {stem}{new} both set"):
        renamed_overrides([f"optimizer={opt}", f"{stem}{old}=0.5", f"{stem}{new}=0.5"], lambda _: None)
    knobs = {old: 0.5, new: 0.5}
    node = {"name": opt, **knobs} if group is None else {"name": opt, "groups": {group: knobs}}
    with pytest.raises(ConfigError, match=rf"sets both {stem}{old} \(the old name\) and {stem}{new}"):
        rename_optimizer(node, lambda _: None)


def test_a_sweep_over_optimizers_that_read_an_old_name_differently_is_refused():
    """Kron's old `b1` is its momentum, AdamW's `b1` is its own: one override cannot mean both. An old
    name the swept optimizers rename alike is renamed for all (Shampoo's and NorMuon's beta2 are not)."""
    with pytest.raises(ConfigError, match=r"^optimizer\.b1 is `optimizer\.momentum` for kron .* stays `optimizer\.b1` "
                                          r"for adamw"):
        renamed_overrides(["-m", "optimizer=kron,adamw", "optimizer.b1=0.8"], lambda _: None)
    with pytest.raises(ConfigError, match=r"^optimizer\.beta2 is an old name, now `optimizer\.precondition_b2` for "
                                          r"shampoo, `optimizer\.b2` for normuon"):
        renamed_overrides(["optimizer=choice(shampoo,normuon)", "optimizer.beta2=0.9"], lambda _: None)
    # a sweep of values, +/++ prefixes and other overrides pass through untouched but for the key
    assert renamed_overrides(["-m", "optimizer=shampoo,soap", "+optimizer.beta2=0.9,0.99", "model.dim=8"],
                             lambda _: None) == ["-m", "optimizer=shampoo,soap", "+optimizer.precondition_b2=0.9,0.99",
                                                 "model.dim=8"]
    assert renamed_overrides(["optimizer.b1=0.8"], lambda _: None) == ["optimizer.b1=0.8"]  # adamw, the default


@pytest.mark.parametrize("opt", sorted(RENAMES))
def test_a_saved_config_with_old_names_validates_to_the_same_run_with_a_warning_each(opt):
    """A config dict as an older eqtrain saved it (with_old_names, from the table) validates to the same
    optimizer as today's; each renamed knob that had a value is one of the run's warnings."""
    current = to_dict(compose_config(f"optimizer={opt}"))
    old = with_old_names(current)
    assert old["optimizer"] != current["optimizer"]
    run, want = validate(old), validate(current)
    assert run.optimizer == want.optimizer
    renamed = [w for w in run.warnings if "is now" in w]
    top = [old_name for group, old_name, _ in renamed_pairs(opt) if group is None and old_name in old["optimizer"]]
    assert len(renamed) == len(top) and all(f"optimizer.{k}`" in " ".join(renamed) for k in top)
    assert run.config_dict["optimizer"] == current["optimizer"]  # what it saves next holds the new names


def test_mars_config_from_before_adam_eps_keeps_its_shared_eps_on_the_scalar_group():
    """MARS's eps set its scalar group's AdamW too before adam_eps existed: such a saved config trains as before."""
    current = to_dict(compose_config("optimizer=mars", "optimizer.eps=1e-6"))
    old = with_old_names(current)
    assert "adam_eps" not in old["optimizer"]
    assert validate(old).optimizer.hparams.adam_eps == 1e-6
    assert validate(current).optimizer.hparams.adam_eps == 1e-8  # today: eps is MARS's own only


def test_a_checkpoint_saved_with_old_names_resumes_under_the_new_ones():
    """merge_config renames the checkpoint's config (a warning each), so nothing is reported as an
    ignored override and the run trains with the saved values under the new names."""
    current = to_dict(compose_config("optimizer=shampoo", "optimizer.precondition_b2=0.99"))
    saved = with_old_names(current)
    lines = []
    source = Source("/old/ck/iter_5", 5, {"step": 5}, saved, with_opt_state=True, resuming=True)
    merged = merge_config(source, current, CheckpointConfig(), lines.append)
    assert merged["optimizer"] == current["optimizer"]
    assert validate(merged).optimizer == validate(current).optimizer
    assert not any("overwrite_config" in line for line in lines)  # no spurious differences
    assert ("optimizer=shampoo (saved in /old/ck/iter_5): `optimizer.beta2` is now `optimizer.precondition_b2`"
            in lines[0])
    assert len(lines) == sum(1 for group, _, _ in renamed_pairs("shampoo") if group is None)


def test_a_comparison_planned_with_old_names_refuses_the_new_names_saying_which(tmp_path):
    """Its runs' ids hold the old name, so the new names plan other runs: refused, naming the old ones."""
    knobs = {"optimizers": ["soap"], "budgets": [10], "lr": {"points": 1}, "warmup": 2}
    old = make_plan(compare_config({**knobs, "sweep": {"soap": {"shampoo_beta": [0.9]}}}), RUN, {"soap": 3e-3})
    new = make_plan(compare_config({**knobs, "sweep": {"soap": {"precondition_b2": [0.9]}}}), RUN, {"soap": 3e-3})
    assert old_knob_names(old.to_json()) == ["optimizer.shampoo_beta"] and old_knob_names(new.to_json()) == []
    launch.open_dir(old, str(tmp_path))
    launch.open_dir(old, str(tmp_path))  # the same command continues it
    with pytest.raises(ConfigError, match=r"holds another comparison .*planned with the old knob names "
                                          r"optimizer\.shampoo_beta, which still work"):
        launch.open_dir(new, str(tmp_path))


def test_lr_find_takes_old_names():
    """scripts/lr_find.py composes its run overrides through utils.config.compose_overrides, which renames."""
    run = load_script("lr_find").compose_run([*TINY_OVERRIDES, "optimizer=kron", "optimizer.b1=0.8"])
    assert run.optimizer.hparams.momentum == 0.8


@pytest.mark.slow
def test_a_comparison_planned_with_old_names_continues(tmp_path, monkeypatch):
    """A comparison sweeping SOAP's old `shampoo_beta` (as an older eqtrain planned it): its runs
    train with precondition_b2 set, and the same command on the same directory continues it (every
    run skipped, nothing refused)."""
    import train_jax as T

    script = load_script("compare")
    seen = []

    def fake_train(cfg, run_dir):
        seen.append(cfg.optimizer.precondition_b2)
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": cfg.train.max_steps, "val/loss": 3.0}) + "\n")

    monkeypatch.setattr(T, "train", fake_train)
    monkeypatch.setattr(script, "build_report", lambda d: None)
    argv = ["optimizers=[soap]", "budgets=[10]", "seeds=1", "lr.points=1", "warmup=2", "sweep.soap.shampoo_beta=[0.9]",
            *RUN, f"dir={tmp_path}"]
    assert script.main(argv) == 0
    assert seen == [0.9, 0.9]  # trunk and branch
    plan = json.loads((tmp_path / "compare.json").read_text())
    assert plan["knobs"]["sweep"] == {"soap.shampoo_beta": [0.9]}  # as planned, so a rerun plans it alike
    assert script.main(argv) == 0
    assert seen == [0.9, 0.9]  # both skipped: done before


def test_train_jax_command_line_renames_before_hydra_and_refuses_both_names_in_one_line(capsys):
    """train_jax.py's __main__ hands Hydra the renamed arguments (cli.renamed_argv): a warning line each
    on stderr; both names given is one `error:` line and exit 2, as every user error."""
    from utils import cli

    argv = ["-m", "optimizer=shampoo", "optimizer.beta2=0.9,0.99", "model.dim=8"]
    assert cli.renamed_argv(argv) == ["-m", "optimizer=shampoo", "optimizer.precondition_b2=0.9,0.99", "model.dim=8"]
    assert capsys.readouterr().err.splitlines() == [
        "warning: optimizer=shampoo: `optimizer.beta2` is now `optimizer.precondition_b2` (the old name still works; "
        "rename it)"]
    with pytest.raises(SystemExit) as exit_:
        cli.renamed_argv(["optimizer=shampoo", "optimizer.beta2=0.9", "optimizer.precondition_b2=0.9"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: optimizer.beta2 (an old name) and ")


def test_setting_a_shared_knob_that_was_split_warns_on_the_command_line():
    """MARS's eps no longer sets its scalar group's AdamW (adam_eps does): an old command line setting eps
    is told, in one line, unless it sets the new knob too."""
    for opt, fills in FILLS.items():
        for new, shared in fills.items():
            lines = []
            renamed_overrides([f"optimizer={opt}", f"optimizer.{shared}=1e-6"], lines.append)
            assert lines == [f"optimizer={opt}: `optimizer.{shared}` no longer also sets what `optimizer.{new}` sets "
                             f"now (see conf/optimizer/{opt}.yaml); set `optimizer.{new}` too to keep the old "
                             "behaviour"]
            lines.clear()
            both = [f"optimizer={opt}", f"optimizer.{shared}=1e-6", f"optimizer.{new}=1e-6"]
            renamed_overrides(both, lines.append)
            assert lines == []
