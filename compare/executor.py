"""One job per run of a comparison, through submitit: the settings of conf/hydra/launcher/{local,slurm}.yaml.

    submit, parallel = make_submit("slurm", ["hydra.launcher.partition=gpu"], compare_dir, command)
    job = submit(run)        # a submitit Job running `command(run)` in its own process / SLURM job

The comparison reads the same launcher configs `train_jax.py -m hydra/launcher=...` uses (and
their `hydra.launcher.*` overrides) and hands them to submitit as hydra-submitit-launcher does:
the fields of its BaseQueueConf as they are, the others prefixed with the executor's name. It
does not go through Hydra's launcher, because a branch must wait for its trunk (compare/
launch.py's run_jobs submits it once the trunk is done), which a Hydra sweep cannot express.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from utils.errors import ConfigError

LAUNCHERS = ("local", "slurm")


def launcher_config(name: str, overrides: list[str]) -> dict[str, Any]:
    """conf/hydra/launcher/<name>.yaml with the `hydra.launcher.*` overrides, as plain values."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from utils.config import CONF_DIR

    if name not in LAUNCHERS:
        raise ConfigError(f"hydra/launcher={name}: a comparison runs with hydra/launcher=local or slurm "
                          "(or without it: in this process)")
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="compare"):
            cfg = compose("config", overrides=[f"hydra/launcher={name}", *overrides], return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    node = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    # interpolations of Hydra's sweep (the folder, the job name) mean nothing here
    return {k: v for k, v in node.items() if not (isinstance(v, str) and "${" in v) and k != "_target_"}


def make_submit(name: str, overrides: list[str], compare_dir: str,
                command: Callable[[Any], list[str]]) -> tuple[Callable[[Any], Any], int]:
    """(submit(run) -> submitit Job, the default number of jobs in flight). `command(run)` is the
    job's argv; it runs in this process's working directory and environment."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = launcher_config(name, overrides)
    parallel = int(params.pop("array_parallelism", 1) or 1) if name == "slurm" else 1
    params.pop("submitit_folder", None)
    init = {f"{name}_max_num_timeout": params.pop("max_num_timeout")} if "max_num_timeout" in params else {}
    executor = submitit.AutoExecutor(folder=os.path.join(compare_dir, ".submitit", "%j"), cluster=name, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    job_name = params.pop("name", None) or "compare"
    executor.update_parameters(name=job_name, **{k if k in base else f"{name}_{k}": v for k, v in params.items()})
    cwd = os.getcwd()

    def submit(run) -> Any:
        return executor.submit(submitit.helpers.CommandFunction(command(run), cwd=cwd, verbose=False))

    return submit, parallel
