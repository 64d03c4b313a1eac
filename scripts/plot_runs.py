"""Plot the curves of one or more runs, or of whole sweeps, to PNG files.

    python scripts/plot_runs.py multirun/2026-11-30/10-00-00          # a sweep: one line per job
    python scripts/plot_runs.py outputs/2026-11-30/10-00-00 outputs/2026-11-30/11-00-00
    python scripts/plot_runs.py outputs/X --metric 'grads/cos(gn, g(n-1))' --metric params/norm --out plots/

Each PATH is a run directory (a folder holding metrics.jsonl, as `train_jax.py` leaves in
outputs/<date>/<time>/ or multirun/<date>/<time>/<job>/) or any folder above run directories,
searched recursively. Written, into --out (default: the first PATH):

    loss_vs_step.png    train/loss (solid) and val/loss (dashed, dots) against the optimizer step
    loss_vs_tokens.png  the same against training tokens: `data/tokens` where logged, else
                        step x tokens per step from the run's .hydra/config.yaml
    loss_vs_time.png    the same against wall time (`time/elapsed_sec`)
    lr.png              train/lr against the step
    grad_norm.png       train/grad_norm against the step
    <metric>.png        one per --metric NAME, against the step; the name made file-safe
                        (`grads/cos(gn, g(n-1))` -> grads_cos_gn_g_n-1.png)

A default plot whose metric (or x axis) no run logged is skipped with a one-line note. One line
per run, labelled by the command-line overrides that differ between the runs
(`optimizer=adamw lr=3e-4`: each key shortened to its shortest unambiguous tail); where a run did
not set a differing key, its value is read from the run's Hydra choices or resolved config. Runs
with no differing override (and a single run) are labelled by their directory names.

A resumed run appends to metrics.jsonl, so a step can appear twice: the records of a step are
merged, a later value winning per metric (the segment that went on), so the resumed segment's
first record (`optim/state_bytes`, `data/...` at the step it resumed from) does not hide the
`train/loss` and `val/loss` the previous segment logged at that step. Bad input (no run directory under a PATH, a
--metric no run logged, a line of metrics.jsonl that is not JSON) exits 2 with one line on stderr.
"""

from __future__ import annotations

import os
import sys

# Run as `python scripts/plot_runs.py`, Python puts scripts/ on sys.path, not the repo root;
# the editable install would find the packages, but only those of the checkout it was made from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import difflib
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import yaml

from utils.errors import DataError, EqtrainError
from utils.files import atomic_write, user_path
from utils.logging.metrics_file import read_metrics
from utils.script_errors import script_error

METRICS_FILE = "metrics.jsonl"  # logging.metrics_file's default; a run's config may name another
TOKENS, ELAPSED = "data/tokens", "time/elapsed_sec"


class PlotError(EqtrainError):
    """A path, file or metric name given to plot_runs cannot be plotted."""


@dataclass
class Run:
    path: str  # the run directory, absolute
    records: list[dict]  # one per logged step, ascending by step; a step's records merged, later values win
    overrides: list[str] = field(default_factory=list)  # .hydra/overrides.yaml
    config: dict = field(default_factory=dict)  # .hydra/config.yaml (as saved: interpolations unresolved)
    choices: dict = field(default_factory=dict)  # hydra.runtime.choices of .hydra/hydra.yaml: group -> option

    def has(self, metric: str) -> bool:
        return any(metric in r for r in self.records)


# ---------------------------------------------------------------------------------------------
# Finding and reading runs


def _read_yaml(path: str):
    """The file's YAML, None when the file is absent; a file that is there but unreadable is an error
    (a half-written config would otherwise give silently wrong labels or token counts)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise PlotError(f"{path}: cannot read it as YAML ({str(e).splitlines()[0]})") from None


def metrics_file(run_dir: str) -> str | None:
    """The run's metrics file: metrics.jsonl, or the `logging.metrics_file` its config names;
    None when `run_dir` is no run directory."""
    default = os.path.join(run_dir, METRICS_FILE)
    if os.path.isfile(default):
        return default
    config = os.path.join(run_dir, ".hydra", "config.yaml")
    if os.path.isfile(config):  # the only YAML read while searching, and only in folders Hydra made
        name = ((_read_yaml(config) or {}).get("logging") or {}).get("metrics_file")
        if isinstance(name, str) and os.path.isfile(os.path.join(run_dir, name)):
            return os.path.join(run_dir, name)
    return None


def _natural(name: str) -> list:
    """Sort key: multirun jobs 0, 1, 2, ..., 10 in numeric, not string, order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_runs(paths: Sequence[str]) -> list[str]:
    """Run directories (absolute, each once, in argument order then natural order) under `paths`:
    each path is a run directory, a metrics file, or a folder searched recursively (not below a run
    directory, nor into hidden folders such as .hydra). Raises PlotError naming a path that does
    not exist or holds no run."""
    found: list[str] = []
    for given in paths:
        path = user_path(given)
        if not os.path.exists(path):
            raise PlotError(f"{given}: no such file or directory")
        if os.path.isfile(path):
            run_dir = os.path.dirname(path)
            if metrics_file(run_dir) != path:
                raise PlotError(f"{given}: not a run directory or its {METRICS_FILE}")
            runs = [run_dir]
        else:
            runs = []
            for folder, subdirs, _ in os.walk(path):
                if metrics_file(folder):
                    runs.append(folder)
                    subdirs[:] = []
                else:
                    subdirs[:] = sorted((d for d in subdirs if not d.startswith(".")), key=_natural)
            if not runs:
                raise PlotError(f"{given}: no run directory there (a folder holding {METRICS_FILE}), "
                                "nor in any folder below it")
        found += [r for r in runs if r not in found]
    return found


def load_metrics(path: str) -> list[dict]:
    """metrics.jsonl -> its records, one per step (utils/logging/sinks/jsonl.read_metrics: a step
    logged twice by a resumed run is merged). Raises PlotError naming file:line of a bad line."""
    try:
        return read_metrics(path)
    except DataError as e:
        raise PlotError(str(e)) from None


def load_run(run_dir: str) -> Run:
    """A run directory's metrics and Hydra files (.hydra/ may be missing: the run then has no
    overrides and no config)."""
    path = user_path(run_dir)
    file = metrics_file(path)
    if file is None:
        raise PlotError(f"{run_dir}: not a run directory (no {METRICS_FILE})")
    hydra_dir = os.path.join(path, ".hydra")
    overrides = _read_yaml(os.path.join(hydra_dir, "overrides.yaml")) or []
    config = _read_yaml(os.path.join(hydra_dir, "config.yaml")) or {}
    hydra = _read_yaml(os.path.join(hydra_dir, "hydra.yaml")) or {}
    choices = ((hydra.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
    return Run(path, load_metrics(file), [str(o) for o in overrides if o is not None],
               config if isinstance(config, dict) else {}, choices if isinstance(choices, dict) else {})


# ---------------------------------------------------------------------------------------------
# Labels


def _parse_override(override: str) -> tuple[str, str]:
    """`optimizer.lr_config.lr=1e-3` -> (key, value); `+key=v`/`++key=v` add, `~key` deletes."""
    key, _, value = override.partition("=")
    if key.startswith("~"):
        return key[1:], "deleted"
    return key.lstrip("+"), value


def _run_value(run: Run, key: str):
    """What `key` was in a run that did not override it: a config group's option from Hydra's
    choices (`optimizer/lr_config` -> cosine), else the value in the saved config (a group's
    `name` when the key names a section); None when unknown."""
    if key in run.choices:
        return run.choices[key]
    node = run.config
    for part in re.split(r"[./]", key):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node.get("name") if isinstance(node, dict) else node


def _same(value) -> object:
    """Comparison form of a value: `3e-4`, `0.0003` and 0.0003 are one learning rate."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Each key -> its shortest tail (split at . and /) that no other key ends with:
    optimizer.lr_config.lr -> lr, unless another differing key also ends in lr."""
    parts = {k: re.split(r"[./]", k) for k in keys}
    short = {}
    for key in keys:
        for n in range(1, len(parts[key]) + 1):
            tail = parts[key][-n:]
            if not any(o != key and parts[o][-n:] == tail for o in keys):
                break
        short[key] = key[len(key) - len(".".join(tail)):] if n < len(parts[key]) else key
    return short


def _dir_names(paths: list[str]) -> list[str]:
    """The shortest path tails that tell the directories apart (10-00-00, or 10-00-00/0 for
    multirun jobs, whose own names are bare numbers)."""
    split = [p.rstrip(os.sep).split(os.sep) for p in paths]
    start = 2 if any(s[-1].isdigit() for s in split) else 1
    for n in range(start, max(len(s) for s in split) + 1):
        names = ["/".join(s[-n:]) for s in split]
        if len(set(names)) == len(names):
            return names
    return ["/".join(s) for s in split]


def labels(runs: Sequence[Run]) -> list[str]:
    """One legend label per run: the overrides that differ between the runs, `key=value` joined by
    spaces with keys shortened (`optimizer=adamw lr=1e-3`); the directory name where no override
    differs (one run, or runs launched alike) or where two labels would be the same."""
    names = _dir_names([r.path for r in runs])
    if len(runs) < 2:
        return names
    given = [dict(_parse_override(o) for o in r.overrides) for r in runs]
    keys = list(dict.fromkeys(k for g in given for k in g))  # first-seen order: the command line's
    values = [{k: g[k] if k in g else _run_value(r, k) for k in keys} for r, g in zip(runs, given)]
    differ = [k for k in keys if len({_same(v[k]) if v[k] is not None else None for v in values}) > 1]
    short = _short_keys(differ)
    out = [" ".join(f"{short[k]}={v[k]}" for k in differ if v[k] is not None) for v in values]
    for i, label in enumerate(out):
        if not label or out.count(label) > 1:
            out[i] = f"{label} ({names[i]})" if label else names[i]
    return out


# ---------------------------------------------------------------------------------------------
# Series and plots


def tokens_per_step(config: dict) -> int | None:
    """Training tokens per optimizer step from a run's saved config: sequences per step
    (dataset.total_batch_size, or dataset.batch_size when null) x tokens per sequence
    (dataset.context_length, or model.context_length when null); train_jax.init_data's
    `accum_steps * batch_size * RunConfig.context_length`. None when the config lacks them."""
    try:
        d, m = config["dataset"], config["model"]
        return int(d.get("total_batch_size") or d["batch_size"]) * int(d.get("context_length") or m["context_length"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def x_values(run: Run, x: str) -> np.ndarray | None:
    """The run's x coordinate at each record (NaN where unknown), None when the run has none:
    x = "step"; "tokens": `data/tokens` where logged, else step x tokens_per_step(config), else
    interpolated between logged values (tokens grow linearly with the step, from 0 at step 0);
    "time": `time/elapsed_sec`, interpolated for records between logged ones (an evaluation-only
    record), NaN outside them."""
    steps = np.array([r["step"] for r in run.records], dtype=float)
    if x == "step":
        return steps
    key = TOKENS if x == "tokens" else ELAPSED
    logged = np.array([_number(r.get(key)) for r in run.records], dtype=float)
    known = np.isfinite(logged)
    per_step = tokens_per_step(run.config) if x == "tokens" else None
    if not known.any() and per_step is None:
        return None
    if per_step is not None:
        fill = steps * per_step
    else:
        ks, kv = steps[known], logged[known]
        if x == "tokens":
            ks, kv = np.concatenate([[0.0], ks]), np.concatenate([[0.0], kv])
        fill = np.interp(steps, ks, kv, left=np.nan, right=np.nan)
    return np.where(known, logged, fill)


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def series(run: Run, metric: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(xs, ys) of the records where the run logged `metric` and both are finite."""
    xs = x_values(run, x)
    if xs is None:
        return np.empty(0), np.empty(0)
    ys = np.array([_number(r.get(metric)) for r in run.records], dtype=float)
    keep = np.isfinite(xs) & np.isfinite(ys)
    return xs[keep], ys[keep]


def safe_name(metric: str) -> str:
    """A file name from a metric name: every run of characters other than letters, digits, `.`,
    `_`, `-` becomes `_` (`grads/cos(gn, g(n-1))` -> `grads_cos_gn_g_n-1`)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", metric).strip("._") or "metric"


def check_metrics(runs: Sequence[Run], metrics: Sequence[str]) -> None:
    """Every --metric must be logged by at least one run; otherwise PlotError, listing a few that are
    (the closest names first)."""
    logged = list(dict.fromkeys(k for r in runs for rec in r.records for k in rec if k != "step"))
    for metric in metrics:
        if not any(r.has(metric) for r in runs):
            close = difflib.get_close_matches(metric, logged, n=3, cutoff=0.5)
            rest = [m for m in logged if m not in close]
            shown = close + rest[: max(0, 8 - len(close))]
            more = f" (+{len(logged) - len(shown)} more)" if len(logged) > len(shown) else ""
            have = f"they log {', '.join(shown)}{more}" if shown else "they log no metrics at all"
            raise PlotError(f"--metric {metric!r}: no run logged it; {have}")


def _time_unit(seconds: float) -> tuple[float, str]:
    return (3600.0, "h") if seconds >= 2 * 3600 else (60.0, "min") if seconds >= 2 * 60 else (1.0, "s")


# The default plots: file, title, x axis, metrics (solid first, then dashed).
LOSS = ("train/loss", "val/loss")
DEFAULT_PLOTS = (
    ("loss_vs_step", "step", LOSS),
    ("loss_vs_tokens", "tokens", LOSS),
    ("loss_vs_time", "time", LOSS),
    ("lr", "step", ("train/lr",)),
    ("grad_norm", "step", ("train/grad_norm",)),
)
X_LABELS = {"step": "step", "tokens": "training tokens", "time": "wall time"}
X_MISSING = {"tokens": f"no run logged {TOKENS} nor has a .hydra/config.yaml giving tokens per step",
             "time": f"no run logged {ELAPSED}"}


def _figure(path: str, x: str, metrics: Sequence[str], runs: Sequence[Run], names: Sequence[str],
            note: Callable[[str], None]) -> bool:
    """Draw one PNG: a colour per run, the first metric solid, the next dashed with dots (val
    points are sparse). False (nothing written) when no run has a point to draw."""
    # The Agg canvas on a bare Figure: no display needed, and no pyplot state to leak between plots.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.1, top=0.93)  # fixed: a layout engine doubles the drawing time
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    data = []  # (run index: its colour in every PNG, label, one (xs, ys) per metric)
    for i, (run, name) in enumerate(zip(runs, names)):
        curves = [series(run, m, x) for m in metrics]
        if any(len(xs) for xs, _ in curves):
            data.append((i, name, curves))
        elif any(run.has(m) for m in metrics):
            note(f"{os.path.basename(path)}: left out {name}: no x values ({X_MISSING.get(x, x)})")
    if not data:
        return False
    scale, unit = 1.0, ""
    if x == "time":  # seconds, minutes or hours, whichever reads best for the longest run
        scale, unit = _time_unit(max(float(xs.max()) for _, _, c in data for xs, _ in c if len(xs)))
    for i, name, curves in data:
        colour, labelled = _colour(i, len(runs)), False
        for j, (xs, ys) in enumerate(curves):
            if len(xs):
                style = {"linestyle": "-"} if j == 0 else {"linestyle": "--", "marker": "o", "markersize": 3}
                ax.plot(xs / scale, ys, color=colour, label=None if labelled else name, **style)
                labelled = True
    drawn = len(data)
    ax.set_xlabel(f"{X_LABELS.get(x, x)} ({unit})" if unit else X_LABELS.get(x, x))
    ax.set_ylabel(metrics[0] if len(metrics) == 1 else "loss")
    title = metrics[0] if len(metrics) == 1 else f"{metrics[0]} (solid), {metrics[1]} (dashed)"
    ax.set_title(f"{title} vs {X_LABELS.get(x, x)}")
    ax.grid(alpha=0.3)
    handles, texts = ax.get_legend_handles_labels()
    texts = [textwrap.fill(t, 70, break_on_hyphens=False) for t in texts]
    if drawn > 6 or any(len(t) > 40 for t in texts):  # long or many labels: beneath the axes, not over the curves
        fig.set_layout_engine("constrained")  # makes room beneath the axes
        fig.legend(handles, texts, loc="outside lower center", fontsize="x-small", ncols=1 if drawn <= 6 else 2)
    else:
        ax.legend(handles, texts, fontsize="small")
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return True


def _colour(i: int, n: int):
    import matplotlib

    if n <= 10:
        return matplotlib.colormaps["tab10"](i)
    return matplotlib.colormaps["viridis"](i / (n - 1))


def plot(runs: Sequence[Run], out_dir: str, metrics: Sequence[str] = (),
         note: Callable[[str], None] = lambda s: print(f"note: {s}", file=sys.stderr)) -> list[str]:
    """Write the default plots and one per metric in `metrics` into `out_dir` (created); returns the
    paths written. A --metric no run logged raises PlotError before any file is written; a default
    plot with nothing to draw is skipped with a `note`."""
    check_metrics(runs, metrics)
    out_dir = user_path(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    names = labels(runs)
    for run in runs:
        if not run.records:
            note(f"{run.path}: its metrics file is empty")
    wanted = list(DEFAULT_PLOTS)
    used = {name for name, _, _ in DEFAULT_PLOTS}
    for metric in dict.fromkeys(metrics):
        name, n = safe_name(metric), 2
        while name in used:  # `--metric lr` beside lr.png, or two names made the same
            name, n = f"{safe_name(metric)}_{n}", n + 1
        used.add(name)
        wanted.append((name, "step", (metric,)))
    written = []
    for name, x, plotted in wanted:
        path = os.path.join(out_dir, f"{name}.png")
        if not any(r.has(m) for r in runs for m in plotted):
            note(f"skipped {name}.png: no run logged {' or '.join(plotted)}")
        elif x != "step" and all(x_values(r, x) is None for r in runs):
            note(f"skipped {name}.png: {X_MISSING[x]}")
        elif _figure(path, x, plotted, runs, names, note):
            written.append(path)
        else:
            note(f"skipped {name}.png: no finite values of {' or '.join(plotted)}")
    return written


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="a run directory (holding metrics.jsonl) or a folder above run directories, e.g. a sweep")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="also plot this metric against the step, e.g. params/norm (repeatable; quote names "
                        "with parentheses or spaces)")
    p.add_argument("--out", metavar="DIR", help="folder for the PNGs; created if missing (default: the first PATH)")
    return p.parse_args(argv)


def _shown(path: str) -> str:
    """A written path as the user would type it: relative to the working directory when below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [load_run(d) for d in find_runs(args.paths)]
        out = args.out
        if out is None:
            first = user_path(args.paths[0])
            out = first if os.path.isdir(first) else os.path.dirname(first)
        written = plot(runs, out, args.metric)
    except (EqtrainError, OSError) as e:
        return script_error(e, where=args.out, hint="check --out")
    for path in written:
        print(_shown(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
