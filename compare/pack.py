"""Which runs of a comparison train together as a pack (`pack=N`), and training a pack's runs.

Runs may share a pack when they would run one step program on the same batches from the same
step to the same step: an equal step key (trainer/process_cache.py's step_view, its argument knobs
masked), the same data (data_key, data_seed, the dataset section), the same train.max_steps,
checkpoint.num_steps and logging.log_every, and the same start (0 for a trunk from scratch, the
branch point for a branch, a resumed run's newest checkpoint). Up to N of them, in plan order;
the runs, their ids, directories and records are those of the unpacked comparison
(compare/launch.py's begin / finish, trainer/pack.py trains them).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import Any, Callable, Sequence

from compare.launch import RUN_JSON, TRAIN_LOG, begin, default_compose, fail_with, finish, read_json, run_dir, run_one
from compare.plan import PlannedRun
from trainer import process_cache
from utils import compile_cache
from utils.checkpoint.storage import complete_steps
from utils.config import to_dict, validate


def start_step(run: PlannedRun, compare_dir: str) -> int:
    """The step `run` will start from: a resumed run's newest checkpoint, else its branch point (0: a trunk)."""
    directory = run_dir(compare_dir, run.id)
    if (read_json(os.path.join(directory, RUN_JSON)) or {}).get("status") == "running":
        saved = complete_steps(os.path.join(directory, "ckpt"))
        if saved:
            return saved[-1]
    return run.branch_step or 0


def pack_key(config, start: int) -> tuple:
    """Equal for runs that may train as one pack (the module's docstring lists why each part is in it)."""
    rc = validate(to_dict(config))
    view = process_cache.masked(process_cache.step_view(rc))
    return (repr(view), process_cache.data_key(rc), rc.data_seed, repr(rc.dataset), rc.train.max_steps,
            rc.checkpoint.num_steps, rc.logging.log_every, start)


def will_train(run: PlannedRun, compare_dir: str) -> bool:
    """Not done or failed before, and (a branch) its trunk done: begin() would let it train."""
    status = (read_json(os.path.join(run_dir(compare_dir, run.id), RUN_JSON)) or {}).get("status")
    if status in ("done", "failed"):
        return False
    if run.kind == "branch":
        trunk = read_json(os.path.join(run_dir(compare_dir, run.trunk), RUN_JSON)) or {}
        return trunk.get("status") == "done"
    return True


class Tee(io.TextIOBase):
    """A text stream writing to several files (a pack's trainer output into each member's train.log);
    not a terminal (isatty False), as a redirected run's log is not."""

    def __init__(self, files):
        super().__init__()
        self.files = files

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for f in self.files:
            f.write(text)
        return len(text)

    def flush(self) -> None:
        for f in self.files:
            f.flush()


@contextlib.contextmanager
def _logged(directories: Sequence[str], quiet: bool):
    if not quiet:
        yield
        return
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(os.path.join(d, TRAIN_LOG), "a", buffering=1)) for d in directories]
        tee = Tee(files)
        with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
            yield


def run_packed(todo: Sequence[PlannedRun], compare_dir: str, pack: int, train: Callable, compose: Callable | None,
               save_every: int | None, say: Callable[[str], None], heads: dict[str, str], quiet: bool,
               on_outcome: Callable[[PlannedRun, str, dict, float], None], keep_checkpoints: bool = False) -> None:
    """Every run of `todo` in plan order, those that train in packs of up to `pack` (each run's
    outcome, record and seconds to `on_outcome` as it ends). A run that will not train (done,
    failed, its trunk failed) goes through begin() alone, as run_one would take it; a run left alone
    trains as run_one trains it (`train`: its own, unpacked program)."""
    compose = compose or default_compose()
    pending = list(todo)
    configs: dict[str, Any] = {}
    keys: dict[str, tuple] = {}

    def key(run: PlannedRun) -> tuple:
        if run.id not in keys:
            configs[run.id] = compose(_overrides(run, compare_dir, save_every, keep_checkpoints))
            keys[run.id] = pack_key(configs[run.id], start_step(run, compare_dir))
        return keys[run.id]

    while pending:
        run = pending.pop(0)
        t0 = time.perf_counter()
        if not will_train(run, compare_dir):
            outcome, record = begin(run, compare_dir, save_every, say, heads[run.id], keep_checkpoints)
            on_outcome(run, outcome, record, time.perf_counter() - t0)
            continue
        group = [run]
        for other in list(pending):
            if len(group) == pack:
                break
            if will_train(other, compare_dir) and key(other) == key(run):
                group.append(other)
                pending.remove(other)
        if len(group) == 1:
            outcome, record = run_one(run, compare_dir, train, compose, save_every, say, heads[run.id], quiet,
                                      keep_checkpoints)
            on_outcome(run, outcome, record, time.perf_counter() - t0)
            continue
        _train_group(group, configs, compose, compare_dir, save_every, say, heads, quiet, on_outcome, t0,
                     keep_checkpoints)


def _train_group(group: list[PlannedRun], configs: dict, compose: Callable, compare_dir: str,
                 save_every: int | None, say: Callable[[str], None], heads: dict[str, str], quiet: bool,
                 on_outcome: Callable, t0: float, keep_checkpoints: bool = False) -> None:
    """begin() each run of `group`, train them as one pack, record each as it ends (finish / fail_with)."""
    from trainer.pack import train_pack

    began = [begin(r, compare_dir, save_every, say, heads[r.id], keep_checkpoints) for r in group]
    overrides = {r.id: b[0] for r, b in zip(group, began)}
    json_paths = {r.id: b[1] for r, b in zip(group, began)}
    if len(group) > 1:
        say(f"  packed: {', '.join(r.id for r in group)}")
    member_configs = [configs.get(r.id) or compose(overrides[r.id]) for r in group]
    compile_cache.enable(to_dict(member_configs[0]))
    ended, lines = [], []  # recorded at once; said on the console once the trainer's output is not redirected

    def on_end(i: int, error) -> None:
        r = group[i]
        if error is None:
            outcome, record = finish(r, overrides[r.id], compare_dir, save_every, lines.append, heads[r.id], t0)
        else:
            outcome, record = fail_with(r, overrides[r.id], json_paths[r.id], lines.append, heads[r.id], error)
        ended.append((r, outcome, record, time.perf_counter() - t0))

    directories = [run_dir(compare_dir, r.id) for r in group]
    try:
        with _logged(directories, quiet):
            train_pack(member_configs, directories, on_end)
    finally:
        for line in lines:
            say(line)
        for r, outcome, record, seconds in ended:
            on_outcome(r, outcome, record, seconds)


def _overrides(run: PlannedRun, compare_dir: str, save_every: int | None, keep_checkpoints: bool) -> list[str]:
    from compare.launch import run_overrides

    return run_overrides(run, compare_dir, save_every, keep_checkpoints)
