"""Every command in README.md and docs/*.md is tested, or says what it needs that a test lacks.

The docs' shell blocks (```bash/```sh) are read line by line, as a user would copy them: `\\`
continuations joined, `&&` split, `#` comments taken off. Then, by what the command is:

- `python train_jax.py ...`: composed with Hydra exactly as typed and validated (utils.config),
  every job of a `-m` sweep (comma lists expanded, Optuna intervals at both ends, the sweeper
  yaml's own search space included). A representative few are also trained, in-process, with
  tiny settings appended, from a scratch working directory (relative paths as typed): the
  tests under "the representative commands that really run".
- `python scripts/X.py ...`: the script's own argument parsing and, where it takes Hydra
  overrides, its config (SCRIPT_ARGS); the same section runs some in-process (`main(argv)`).
- `python bench/X.py ...`: its flags are checked against the script's argparse definitions and
  its overrides validated; benchmarks take minutes, so each must say `needs: minutes`.
- anything else: COVERED_ELSEWHERE names the test that runs it (and this file checks that test
  exists), or the line says `needs: gpu | network | cluster | minutes` (README, "Commands in
  these docs"). A command with neither fails test_every_command_is_covered_or_marked.

Python blocks in the docs are verbatim copies of docs/examples.py or optimizer/lion.py (which
tests/test_docs_examples.py runs) or are executed here (PYTHON_SNIPPETS). Relative links of
every page point at files (and headings) that exist.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import CLI_TINY, load_script

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("gpu", "network", "cluster", "minutes")
NEEDS = re.compile(r"\bneeds: (\w+)")
SHELL = ("bash", "sh", "shell")


# --- reading the docs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    body: str


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # the command as typed, comment removed, continuations joined (runs of spaces as one)
    words: tuple[str, ...]  # after any VAR=value, sudo, /usr/bin/time, nice -n N prefix
    prefix: tuple[str, ...]  # that prefix
    needs: str | None = None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"

    @property
    def typed(self) -> str:
        return shlex.join([*self.prefix, *self.words])


def _blocks(path: Path) -> list[Block]:
    """Fenced blocks of a page, fences at any indentation (a block inside a list item too)."""
    out, lines = [], path.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if m:
            indent, lang, start, body = m.group(1), m.group(2), i, []
            i += 1
            while not re.match(rf"^{indent}```\s*$", lines[i]):
                body.append(lines[i][len(indent):])
                i += 1
            out.append(Block(path.relative_to(ROOT).as_posix(), start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return out


BLOCKS = [b for p in PAGES for b in _blocks(p)]


_split_yaml_or_shell = load_script("knob_reference").split_comment


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the first # that starts a word outside quotes."""
    code, comment = _split_yaml_or_shell(line)
    return code, comment or ""


def _strip_prefix(words: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    prefix = []
    while words:
        if re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("sudo", "/usr/bin/time"):
            prefix.append(words.pop(0))
        elif words[0] == "nice" and len(words) > 2 and words[1] == "-n":
            prefix += words[:3]
            del words[:3]
        else:
            break
    return tuple(prefix), tuple(words)


def _commands(block: Block) -> list[Command]:
    out, pending, first = [], "", None
    for n, raw in enumerate(block.body.split("\n")):
        if not raw.strip() and not pending:
            continue
        if first is None:
            first = block.line + 1 + n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        code, comment = _split_comment(pending + raw)
        pending, line = "", first
        first = None
        if not code.strip():
            continue
        m = NEEDS.search(comment)
        needs = m.group(1) if m else None
        assert needs in (None, *KINDS), f"{block.page}:{line}: unknown marker 'needs: {needs}' (one of {KINDS})"
        for raw in re.split(r"\s+&&\s+", code.strip()):
            prefix, words = _strip_prefix(shlex.split(raw))
            out.append(Command(block.page, line, re.sub(r"\s+", " ", raw), words, prefix, needs))
    return out


GENERATED = "docs/knobs.md"  # scripts/knob_reference.py writes it from yaml comments: its fences are bare


def _is_shell(block: Block) -> bool:
    return block.lang in SHELL or (block.page == GENERATED and not block.lang and block.body.startswith("python "))


COMMANDS = [c for b in BLOCKS if _is_shell(b) for c in _commands(b)]


def _is(cmd: Command, program: str) -> bool:
    return cmd.words[:1] == ("python",) and len(cmd.words) > 1 and cmd.words[1] == program


def _script(cmd: Command) -> str | None:
    m = re.fullmatch(r"scripts/(\w+)\.py", cmd.words[1]) if cmd.words[:1] == ("python",) else None
    return m.group(1) if m else None


def _bench(cmd: Command) -> bool:
    return cmd.words[:1] == ("python",) and bool(re.fullmatch(r"bench/\w+\.py", cmd.words[1]))


TRAIN = [c for c in COMMANDS if _is(c, "train_jax.py")]


# --- what covers the commands no test here runs ----------------------------------------------------

def _node_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    return (ROOT / path).is_file() and bool(re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M))


def _ci_lines() -> list[str]:
    return (ROOT / ".ci" / "run").read_text().split("\n")


# command as typed -> what runs it: a test ("tests/x.py::test_name") or a file check (callable)
COVERED_ELSEWHERE = {
    # CI's test command, and the dev extra installs pytest-xdist
    "pytest -n 2 --dist loadfile": lambda: "pytest -n 2 --dist loadfile" in _ci_lines()
    and "pytest-xdist" in (ROOT / "pyproject.toml").read_text().split("parity = [")[0],
    "ruff check .": lambda: "ruff check ." in (ROOT / ".ci" / "run").read_text().split("\n"),  # CI lints first
    # the marker exists and is used, and the dev extra installs pytest-xdist (-n, --dist)
    "pytest -m 'not slow' -n 2 --dist loadfile": lambda: '"slow:' in (ROOT / "pyproject.toml").read_text()
    and any("pytest.mark.slow" in p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    and "pytest-xdist" in (ROOT / "pyproject.toml").read_text().split("parity = [")[0],
    "SMOKE=1 bash scripts/train_lm.sh":
        "tests/test_cli.py::test_train_lm_script_smoke_forwards_the_slurm_signal_and_resumes",
    "tensorboard --logdir outputs": "tests/test_sinks.py::test_tensorboard_events_read_back",
    "sudo bash scripts/slurm/local_cluster.sh": "tests/test_slurm.py::test_local_cluster_script_second_run_is_quick",
    # parsed by lm-eval's own command line and run through lm_eval.simple_evaluate on a tiny export
    "lm_eval --model hf --model_args pretrained=hf_model,dtype=float32 --include_path my_tasks/ --tasks my_task "
    "--device cpu --batch_size 4":
        "tests/test_lm_eval.py::test_the_docs_lm_eval_command_on_the_export_gives_our_scorers_accuracies",
}


def _covered_elsewhere(cmd: Command) -> str | None:
    target = COVERED_ELSEWHERE.get(cmd.typed)
    if target is None:
        return None
    if callable(target):
        assert target(), f"{cmd}: its check in COVERED_ELSEWHERE no longer holds"
        return "checked"
    assert _node_exists(target), f"{cmd}: COVERED_ELSEWHERE names {target}, which does not exist"
    return target


def test_every_command_is_covered_or_marked():
    assert len(COMMANDS) > 40 and len(TRAIN) > 20  # the extraction still finds the docs' commands
    unmarked_bench = [str(c) for c in COMMANDS if _bench(c) and c.needs is None]
    assert not unmarked_bench, "benchmarks run for minutes: mark them `needs: minutes`:\n" + "\n".join(unmarked_bench)
    orphans = []
    for cmd in COMMANDS:
        covered = (_is(cmd, "train_jax.py") or _script(cmd) in SCRIPT_ARGS or _bench(cmd)
                   or _covered_elsewhere(cmd) or cmd.needs)
        if not covered:
            orphans.append(str(cmd))
    assert not orphans, ("commands no test runs and no `needs:` marker explains (add a test, a COVERED_ELSEWHERE "
                         "entry, or a marker):\n" + "\n".join(orphans))


def test_covered_elsewhere_entries_are_used():
    typed = {c.typed for c in COMMANDS}
    assert not set(COVERED_ELSEWHERE) - typed, f"stale COVERED_ELSEWHERE keys: {set(COVERED_ELSEWHERE) - typed}"


def test_every_fence_names_its_language():
    """A shell block is ```bash; output and diagrams are ```text, so no command hides in them."""
    bare = [f"{b.page}:{b.line}" for b in BLOCKS if not b.lang and b.page != GENERATED]
    assert not bare, f"fenced blocks without a language: {bare}"
    assert {b.lang for b in BLOCKS if b.page != GENERATED} <= {*SHELL, "text", "python"}


# --- python train_jax.py: composed and validated as typed, every sweep job ---------------------------

def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of the jobs a command launches: one, or a sweep's cartesian product
    (the sweeper yaml's params included, the command line winning per key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    if not multirun:
        return [overrides]
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    sweeps = {o.get_key_element(): o for o in parsed if o.is_sweep_override()}
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    params = _sweeper_params(fixed)
    for key, value in params.items():
        if key not in sweeps:
            (o,) = parser.parse_overrides([f"{key}={value}"])
            sweeps[key] = o
    axes = []
    for key, o in sweeps.items():
        if o.value_type == ValueType.INTERVAL_SWEEP:
            values = [o.value().start, o.value().end]
        else:
            values = list(o.sweep_string_iterator())
        axes.append([f"{key}={v}" for v in values])
    return [fixed + list(job) for job in itertools.product(*axes)] or [fixed]


def _sweeper_params(fixed: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="train_jax"):
        cfg = compose("config", overrides=fixed, return_hydra_config=True)
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    return dict(params) if params else {}


@functools.cache
def _composed(overrides: tuple[str, ...]):
    """utils.config.compose_overrides of these overrides, once: the pages repeat many commands (the
    bare `python train_jax.py` nine times) and each composition takes ~0.1 s. The config is only
    validated, which reads it; a composition error is raised again each time (not cached)."""
    from utils.config import compose_overrides

    return compose_overrides(list(overrides), "train_jax")


def _validated(cmd: Command, *extra: str) -> list:
    from utils.config import validate

    args = list(cmd.words[2:])
    multirun = bool({"-m", "--multirun"} & set(args))
    args = [a for a in args if a not in ("-m", "--multirun")]
    assert all("=" in a or a.startswith("~") for a in args), f"{cmd}: not Hydra overrides: {args}"
    return [validate(_composed((*job, *extra))) for job in _jobs(args, multirun)]


@pytest.mark.slow  # composes every train command of the docs: 24 s, the quick set's largest
def test_train_commands_compose_and_validate():
    jobs, failures = 0, []
    for cmd in TRAIN:
        try:
            jobs += len(_validated(cmd))
        except Exception as e:  # noqa: BLE001 - every bad command is listed, not only the first
            failures.append(f"{cmd}\n    {type(e).__name__}: {e}")
    assert not failures, "docs commands whose config does not validate:\n" + "\n".join(failures)
    assert jobs >= len(TRAIN) + 10  # the sweeps were expanded


def test_sweeps_expand_to_every_job():
    four = _find("README.md", "python train_jax.py -m optimizer=adamw,sgdm optimizer.lr_config.lr=1e-3,3e-4",
                 exact=True)
    runs = _validated(four)
    assert sorted((r.optimizer.name, r.optimizer.schedule.lr) for r in runs) == [
        ("adamw", 3e-4), ("adamw", 1e-3), ("sgdm", 3e-4), ("sgdm", 1e-3)]
    optuna = _find("README.md", "python train_jax.py -m hydra/sweeper=optuna_lr", exact=True)
    assert sorted(r.optimizer.schedule.lr for r in _validated(optuna)) == [1e-4, 1e-1]  # the yaml's interval


# --- the scripts: their own argument parsing, and their config -------------------------------------

def _hydra_args(module, argv: list[str]):
    from utils.config import validate

    ours, overrides = module.split_argv(argv)
    return ours, validate(_composed(tuple(overrides)))


def _lr_find_args(argv):
    from utils.sections import build_section

    module = load_script("lr_find")
    node, overrides = module.split_argv(argv)
    build_section(module.LRFindConfig, node, "lr_find")
    from utils.config import validate

    return validate(_composed(tuple(overrides)))


def _compare_args(argv):
    """scripts/compare.py: `--report DIR`, or the comparison's knobs (conf/compare.yaml, checked by
    compare.plan.compare_config) and the run overrides (validated as a run's)."""
    if argv[:1] == ["--report"]:
        return len(argv) == 2
    from compare.executor import launcher_config
    from compare.plan import compare_config
    from utils.config import validate

    module = load_script("compare")
    ours, theirs, launcher = module.split_argv(argv)
    compare_config(module.compose_knobs(ours))
    names = [a.split("=", 1)[1] for a in launcher if a.startswith("hydra/launcher=")]
    if launcher:
        launcher_config(names[-1], [a for a in launcher if a.startswith("hydra.")])
    return validate(_composed(tuple(theirs)))


SCRIPT_ARGS = {  # script -> how its command line is checked without running it
    "compare": _compare_args,
    "lr_find": _lr_find_args,
    "prepare_data": lambda argv: _hydra_args(load_script("prepare_data"), argv),
    "plot_runs": lambda argv: load_script("plot_runs").parse_args(argv),
    "export_model": lambda argv: load_script("export_model").parse_args(argv),
    "sample": lambda argv: load_script("sample").parse_args(argv),
    "knob_reference": lambda argv: not argv,  # no arguments; tests/test_knob_reference.py runs it
    "coord_check": lambda argv: _coord_check_args(argv),  # tests/test_mup.py runs it (tiny widths)
    "mup_transfer": lambda argv: _mup_transfer_args(argv),  # tests/test_mup.py runs its sweep (the test's ladder)
}


def _coord_check_args(argv: list[str]) -> bool:
    """Its flags parsed and every point's config validated at the smallest width (nothing trains)."""
    coord = load_script("coord_check")
    args = coord.parse_args(argv)
    for opt in args.optimizers:
        for mup in (False, True):
            coord.build_run(opt, min(args.widths), mup, args.base_dim, args.overrides)
    return True


def _mup_transfer_args(argv: list[str]) -> bool:
    """Its flags parsed and every point's config validated at the smallest width (nothing trains)."""
    coord, args = load_script("coord_check"), load_script("mup_transfer").parse_args(argv)
    for opt in args.optimizers:
        for mup in (False, True):
            steps = f"train.max_steps={args.steps}"
            coord.build_run(opt, min(args.widths), mup, args.base_dim, [steps, *args.overrides])
    return True


def test_script_commands_parse():
    scripts = [c for c in COMMANDS if _script(c)]
    assert {_script(c) for c in scripts} <= set(SCRIPT_ARGS), {_script(c) for c in scripts} - set(SCRIPT_ARGS)
    for cmd in scripts:
        assert SCRIPT_ARGS[_script(cmd)](list(cmd.words[2:])) is not False, cmd


def _argparse_flags(path: Path) -> set[str]:
    """The option strings of every `add_argument(...)` call in a script (read, not imported: a
    benchmark may need what this machine lacks, torch, or set XLA_FLAGS at import)."""
    calls = re.findall(r"add_argument\(([^)]*)", path.read_text())
    return {flag for call in calls for flag in re.findall(r"[\"'](--?[\w-]+)[\"']", call)}


def test_bench_commands_use_flags_their_script_defines():
    from utils.config import validate

    benches = [c for c in COMMANDS if _bench(c)]
    assert benches
    for cmd in benches:
        path = ROOT / cmd.words[1]
        assert path.is_file(), cmd
        known = _argparse_flags(path) | {"-h", "--help"}
        args = list(cmd.words[2:])
        flags = {a.split("=")[0] for a in args if a.startswith("-")}
        assert flags <= known, f"{cmd}: {flags - known} not among {path.name}'s flags {sorted(known)}"
        if path.name == "compare_speed.py":  # --side NAME=CHECKOUT, then scripts/compare.py's own arguments
            values = {b for a, b in zip(args, args[1:]) if a in ("--side", "--pairs", "--side-arg")}
            side_args = [b.split("=", 1)[1] for a, b in zip(args, args[1:]) if a == "--side-arg"]  # NAME=ARG
            compare_args = [a for a in args if not a.startswith("-") and a not in values] + side_args
            assert _compare_args(compare_args) is not False, cmd
            continue
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        if overrides:
            validate(_composed(tuple(overrides)))


# --- the representative commands that really run -----------------------------------------------------

# Appended to a run's command: a model that compiles in a second, a few steps, nothing sampled.
TINY = (*CLI_TINY, "train.sample_tokens=0", "logging.sample_prompts=[]", "logging.progress_bar=false")


def _find(page: str, start: str, exact: bool = False) -> Command:
    found = [c for c in COMMANDS if c.page == page and (c.text == start if exact else c.text.startswith(start))]
    assert len(found) == 1, f"{page}: {len(found)} commands start with {start!r} (the docs changed: update this test)"
    return found[0]


def _train(cmd: Command, run_dir: Path, *extra: str) -> dict:
    import train_jax
    from utils.config import compose_overrides, to_dict

    args = [a for a in cmd.words[2:]]
    cfg = compose_overrides([*args, *TINY, *extra], "train_jax")
    run_dir.mkdir(parents=True, exist_ok=True)  # Hydra makes it before a job starts
    return train_jax.train(to_dict(cfg), str(run_dir))


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory for commands typed with relative paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_the_default_run(scratch):
    """README: `python train_jax.py`, 20 tiny steps."""
    cmd = _find("README.md", "python train_jax.py", exact=True)
    last = _train(cmd, scratch / "outputs" / "run", "train.max_steps=20", "train.val_freq=10")
    assert last["val/loss"] < 6 and (scratch / "outputs" / "run" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_checkpoint_commands_in_order(scratch, capsys):
    """docs/checkpoints.md from the top: save at a list of steps, resume, load iter_100 into a new
    run, export, sample: every path relative, as typed."""
    page = "docs/checkpoints.md"
    save = _find(page, "python train_jax.py checkpoint.save=true checkpoint.save_path=ckpt/run1 checkpoint.save_steps=")
    _train(save, scratch / "out" / "1", "train.max_steps=110", "train.val_freq=100")
    assert {p.name for p in (scratch / "ckpt" / "run1").iterdir()} >= {"iter_100", "iter_110"}  # the list, the end
    resume = _find(page, "python train_jax.py checkpoint.save=true checkpoint.save_path=ckpt/run1 "
                         "checkpoint.resume=auto")
    _train(resume, scratch / "out" / "2")
    assert "nothing to train" in capsys.readouterr().out
    load = _find(page, "python train_jax.py checkpoint.load=true checkpoint.load_path=ckpt/run1 checkpoint.load_file="
                       "iter_100 checkpoint.save=true")
    _train(load, scratch / "out" / "3")  # the saved config: 100 -> 110
    assert (scratch / "ckpt" / "run1-ft" / "iter_110").is_dir()
    (scratch / "corpus").mkdir()
    for i in range(12):
        (scratch / "corpus" / f"doc{i}.txt").write_text(f"document {i}\n" + "other text to go on with. " * 40)
    other_data = _find(page, "python train_jax.py checkpoint.load=true checkpoint.load_path=ckpt/run1 "
                             "checkpoint.load_file=iter_100 checkpoint.overwrite_data=true")
    _train(other_data, scratch / "out" / "3b")  # 100 -> 110 on corpus/*.txt, its stream from the start
    saved = json.loads((scratch / "ckpt" / "run1-corpus" / "iter_110" / "manifest" / "manifest.json").read_text())
    assert saved["step"] == 110 and "corpus" in (scratch / "ckpt" / "run1-corpus" / "iter_110" / "config" /
                                                  "config.yaml").read_text()
    export = _find(page, "python scripts/export_model.py ckpt/run1")
    assert load_script("export_model").main(list(export.words[2:])) == 0
    assert {"model.safetensors", "config.json"} <= {p.name for p in (scratch / "export" / "run1").iterdir()}
    sample = _find(page, "python scripts/sample.py ckpt/run1")
    capsys.readouterr()
    assert load_script("sample").main(list(sample.words[2:])) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow
def test_token_files_offline(scratch):
    """docs/data.md: prepare_data on your own text, then train on the token files."""
    (scratch / "data").mkdir()
    for i in range(12):
        (scratch / "data" / f"doc{i}.txt").write_text(f"document {i}\n" + "some text to train on. " * 40)
    prepare = _find("docs/data.md", "python scripts/prepare_data.py dataset=text_files")
    assert load_script("prepare_data").main([*prepare.words[2:], "workers=1"]) == 0
    train = _find("docs/data.md", "python train_jax.py dataset=memmap dataset.path=data/mine")
    last = _train(train, scratch / "out", "train.max_steps=4", "train.val_freq=4")
    assert "val/loss" in last


def _fake_run(path: Path, overrides: list[str], steps: int = 5) -> None:
    """A run directory as train_jax.py and Hydra leave it (metrics.jsonl, .hydra/)."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (path / ".hydra" / "config.yaml").write_text("dataset:\n  batch_size: 8\n  total_batch_size: null\n"
                                                  "  context_length: 32\nmodel:\n  context_length: 32\n")
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "train/loss": 5.0 / s, "val/loss": 5.5 / s, "train/lr": 1e-3,
                                "train/grad_norm": 1.0 / s, "data/tokens": 256 * s, "time/elapsed_sec": 0.5 * s,
                                "grads/cos(gn, g(n-1))": 0.1 * s, "params/norm": 10.0 + s}) + "\n")


def test_plot_commands(scratch, capsys):
    """README's and docs/metrics.md's plot_runs commands, on run directories where they say."""
    plot = load_script("plot_runs")
    for job, opt in enumerate(("adamw", "sgdm")):
        _fake_run(scratch / "multirun" / "2026-11-30" / "10-00-00" / str(job), [f"optimizer={opt}"])
    _fake_run(scratch / "outputs" / "2026-11-30" / "10-00-00", ["optimizer=adamw"])
    _fake_run(scratch / "outputs" / "2026-11-30" / "11-00-00", ["optimizer=muon"])
    commands = [c for c in COMMANDS if _script(c) == "plot_runs"]
    assert len(commands) >= 4
    for cmd in commands:
        assert plot.main(list(cmd.words[2:])) == 0, cmd
    assert (scratch / "plots" / "loss_vs_step.png").is_file()
    assert (scratch / "outputs" / "2026-11-30" / "10-00-00" / "grads_cos_gn_g_n-1.png").is_file()


@pytest.mark.slow
def test_lr_find(scratch):
    """docs/optimizers.md's fully spelled-out lr_find, on the tiny model and 10 steps."""
    cmd = _find("docs/optimizers.md", "python scripts/lr_find.py optimizer=adamw model=gpt_tiny")
    argv = [*cmd.words[2:], *TINY, "lr_find.steps=10", "lr_find.out_dir=lr"]
    assert load_script("lr_find").main(argv) == 0
    assert {"lr_find.png", "lr_find.csv", "summary.json"} <= {p.name for p in (scratch / "lr").iterdir()}



# --- python blocks ---------------------------------------------------------------------------------

def _run_diagnostics_snippet(code: str) -> None:
    """docs/metrics.md's `diagnostics` method, on an AdamW subclass, through optimizer_metrics."""
    import jax
    import jax.numpy as jnp
    import optax

    from optimizer import make_optimizer
    from optimizer.adamw import AdamW
    from optimizer.diagnostics import find_states, optimizer_metrics

    namespace = {"jax": jax, "optax": optax, "find_states": find_states}
    exec(compile("class Mine(AdamW):\n" + textwrap.indent(textwrap.dedent(code), "    "), "docs/metrics.md", "exec"),
         {"AdamW": AdamW, **namespace}, namespace)
    hparams = namespace["Mine"]()
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
    labels = {"w": "hidden", "b": "scalar"}
    tx = make_optimizer(hparams, optax.constant_schedule(1e-2), labels, 1.0, 1e-2, {})
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    metrics = optimizer_metrics(hparams, state, params)
    assert float(metrics["optim/hidden/mu_norm"]) > 0 and "optim/scalar/mu_norm" in metrics


def _run_task_conversions(code: str) -> None:
    """docs/metrics.md's conversions of the Hugging Face task datasets, on one fake row each (the
    datasets' columns), each written with its write_jsonl and read back as an eval.tasks file."""
    import tempfile

    from loaders.tasks import read_task

    namespace: dict = {}
    exec(compile(code, "docs/metrics.md", "exec"), namespace)
    rows = {
        "hellaswag": {"activity_label": "Cooking", "ctx_a": "A man cuts an onion.", "ctx_b": "he",
                      "endings": ["puts it in a pan [title] then.", " eats  it."], "label": "1"},
        "arc": {"question": "2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"},
        "piqa": {"goal": "Dry a shirt", "sol1": "hang it", "sol2": "wet it", "label": 0},
        "lambada": {"text": "she opened the door"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tasks = {}
        for name, row in rows.items():
            namespace["write_jsonl"]([row], namespace[name], f"{tmp}/{name}.jsonl")
            tasks[name] = read_task(f"{tmp}/{name}.jsonl")
    h = tasks["hellaswag"]  # lm-eval's preprocess: " [title]" -> ". ", [..] dropped, double spaces single
    assert (h.contexts, h.choices, h.golds) == (("Cooking: A man cuts an onion. He ",),
                                                (("puts it in a pan. then.", "eats it."),), (1,))
    assert tasks["arc"].contexts == ("Question: 2+2?\nAnswer: ",) and tasks["arc"].golds == (1,)
    assert tasks["piqa"].choices == (("hang it", "wet it"),) and tasks["piqa"].golds == (0,)
    assert (tasks["lambada"].kind, tasks["lambada"].contexts, tasks["lambada"].choices) == (
        "cloze", ("she opened the",), ((" door",),))


PYTHON_SNIPPETS = {  # the first line of a block -> how it runs
    "    def diagnostics(self, group: str, group_state, params) -> dict[str, jax.Array]:": _run_diagnostics_snippet,
    "# lm-eval's prompts: a Hugging Face dataset's row -> one line of an eval.tasks file": _run_task_conversions,
}


def test_python_blocks_are_examples_or_run():
    verbatim = "".join((ROOT / path).read_text() for path in ("docs/examples.py", "optimizer/lion.py",
                                                              "docs/example_family.py"))  # test_model_contract runs it
    ran = 0
    for block in (b for b in BLOCKS if b.lang == "python"):
        if block.body in verbatim:
            continue
        runner = PYTHON_SNIPPETS.get(block.body.split("\n", 1)[0])
        assert runner, f"{block.page}:{block.line}: a python block neither in docs/examples.py nor run here"
        runner(block.body)
        ran += 1
    assert ran == len(PYTHON_SNIPPETS)


# --- links -----------------------------------------------------------------------------------------

def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().split("\n"):
        m = re.match(r"^#+\s+(.*)$", line)
        if m:
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())))
    return out


def test_relative_links_point_at_files_and_headings():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_door_that_maps_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 250
    for page in (ROOT / "docs").iterdir():
        if page.suffix in (".md", ".py"):
            assert f"](docs/{page.name})" in readme, f"README does not link docs/{page.name}"
