"""What a checkpoint save of a small state costs under orbax settings a comparison's runs could use:
save()'s blocking part and the save until its files are written, per setting, alternated.

    python bench/save_settings.py --rounds 2                   # gpt_tiny's AdamW state (~10 MB)

Settings (each patches utils/checkpoint/storage.py's orbax objects for its own process):
  base        the checkpointer as it is
  zarr3       PyTreeCheckpointHandler(use_zarr3=True)
  asyncdirs   AsyncOptions(create_directories_asynchronously=True)
  norootmeta  CheckpointManagerOptions(save_root_metadata=False, prevent_write_metrics=True)
Each round runs every setting in a fresh process (one warm-up save, then 8 timed saves of the same
state, each waited for), the order reversed every other round. Prints the medians. Needs: minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("base", "zarr3", "asyncdirs", "norootmeta")


def patch(setting: str) -> None:
    import functools

    import orbax.checkpoint as ocp

    from utils.checkpoint import storage

    if setting == "zarr3":
        storage.ocp.PyTreeCheckpointHandler = functools.partial(ocp.PyTreeCheckpointHandler, use_zarr3=True)
    options = ocp.CheckpointManagerOptions
    extra = {"asyncdirs": {"async_options": ocp.options.AsyncOptions(create_directories_asynchronously=True)},
             "norootmeta": {"save_root_metadata": False, "prevent_write_metrics": True}}.get(setting)
    if extra:
        storage.ocp.CheckpointManagerOptions = lambda **k: options(**k, **extra)


def one(setting: str) -> None:
    import dataclasses
    import shutil
    import statistics
    import tempfile
    import time

    sys.path.insert(0, REPO)
    from hydra import compose, initialize_config_dir

    import train_jax as T
    from utils.checkpoint import storage
    from utils.config import CONF_DIR, validate
    from utils.parallel import mesh as meshlib

    patch(setting)
    tmp = tempfile.mkdtemp()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["model=gpt_tiny", "checkpoint.save=true", f"checkpoint.save_path={tmp}/c",
                                           "checkpoint.save_steps=[1]", "checkpoint.max_to_keep=null"])
    run = validate(cfg)
    p = run.parallel
    mesh = meshlib.make_mesh(p.data, p.fsdp, run.dataset.batch_size, tensor=p.tensor, expert=p.expert)
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=256))
    _, _, state, _ = T.init_training(run, mesh)
    saver = storage.Checkpointer(run.checkpoint, run.config_dict, dataclasses.asdict(run.model), print)
    saver.save(100, state, {}, {}, "warm-up")
    saver.wait()
    blocking, total = [], []
    for step in range(1, 9):
        t0 = time.perf_counter()
        saver.save(step, state, {}, {}, "timed")
        t1 = time.perf_counter()
        saver.wait()
        blocking.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    saver.close()
    shutil.rmtree(tmp)
    print(f"{setting:<11} save() blocks {statistics.median(blocking):.3f} s, written after "
          f"{statistics.median(total):.3f} s (median of 8)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args.one)
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            subprocess.run([sys.executable, __file__, "--one", setting], check=True)


if __name__ == "__main__":
    main()
