"""scripts/xla_gpu_flags.sh, which scripts/train_lm.sh and scripts/slurm/train.sbatch source: XLA's GPU
flags are added on an NVIDIA GPU only (a stand-in nvidia-smi first on PATH plays the machine), never
on a CPU (XLA_FLAGS keys the compilation cache and the cached CPU peak), and a user's own XLA_FLAGS
are kept."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LHS = "--xla_gpu_enable_latency_hiding_scheduler"


def flags_after(tmp_path: Path, gpu: bool, **env: str) -> subprocess.CompletedProcess:
    """XLA_FLAGS after sourcing the helper and calling it, on a machine whose nvidia-smi does (or
    does not: it fails, as it does without a driver or device) list a GPU."""
    stub = tmp_path / "bin" / "nvidia-smi"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    stub.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "EQTRAIN_GPU_FLAGS")}
    script = 'source scripts/xla_gpu_flags.sh && eqtrain_xla_gpu_flags && printf %s "${XLA_FLAGS-<unset>}"'
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={**base, "PATH": f"{stub.parent}:{base['PATH']}", **env})


def test_gpu_gets_the_flags_and_cpu_gets_none(tmp_path):
    assert flags_after(tmp_path, gpu=True).stdout == f"{LHS}=true"
    assert flags_after(tmp_path, gpu=False).stdout == "<unset>"
    assert flags_after(tmp_path, gpu=False, XLA_FLAGS="--xla_dump_to=d").stdout == "--xla_dump_to=d"


@pytest.mark.parametrize("mine", [f"{LHS}=false", LHS])
def test_users_own_setting_and_other_flags_are_kept(tmp_path, mine):
    out = flags_after(tmp_path, gpu=True, XLA_FLAGS=f"--xla_dump_to=d {mine}").stdout
    assert out == f"--xla_dump_to=d {mine}"
    assert flags_after(tmp_path, gpu=True, XLA_FLAGS="--xla_dump_to=d").stdout == f"--xla_dump_to=d {LHS}=true"


def test_the_env_knob_forces_or_skips_and_rejects_other_values(tmp_path):
    assert flags_after(tmp_path, gpu=True, EQTRAIN_GPU_FLAGS="0").stdout == "<unset>"
    assert flags_after(tmp_path, gpu=False, EQTRAIN_GPU_FLAGS="1").stdout == f"{LHS}=true"
    bad = flags_after(tmp_path, gpu=True, EQTRAIN_GPU_FLAGS="yes")
    assert bad.returncode == 2 and "EQTRAIN_GPU_FLAGS=yes: use auto" in bad.stderr


@pytest.mark.parametrize("script", ["scripts/train_lm.sh", "scripts/slurm/train.sbatch"])
def test_launch_scripts_set_the_flags_before_starting_the_trainer(script):
    text = (REPO / script).read_text()
    call = text.index("eqtrain_xla_gpu_flags")
    assert text.index("source scripts/xla_gpu_flags.sh") < call < text.index("python train_jax.py")
