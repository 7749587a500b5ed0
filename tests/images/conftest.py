"""The `docker` fixture: a client that builds with BuildKit and a daemon it reaches.

When no daemon answers, the fixture starts dockerd for the session (as root, like the Slurm fixture's
daemons) and stops it at the end; a daemon that was already running is used and left alone. What cannot be
had (no client, no dockerd, not root, a daemon that does not come up) fails the tests that need it, naming
the piece: they are never skipped. `make test` installs docker.io when it is missing;
`-m "not gpu and not upstream_src and not docker"` deselects these tests (pytest reports them as deselected).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .recipes import CPU_TEST_IMAGE, make

START_TIMEOUT_S = 60


def docker_client() -> str | None:
    """A client that can build with BuildKit (RUN --mount): docker + buildx, or Debian's 20.10 client."""
    candidates = [os.environ.get("DOCKER"), shutil.which("docker"), "/usr/bin/docker"]
    for client in filter(None, dict.fromkeys(candidates)):
        if not shutil.which(client):
            continue
        if subprocess.run([client, "buildx", "version"], capture_output=True).returncode == 0:
            return client
        # the client prints its version even when no daemon answers (and then exits 1)
        version = subprocess.run([client, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True)
        major = version.stdout.strip().split(".")[0]
        if major.isdigit() and int(major) < 23:  # BuildKit built into the classic client
            return client
    return None


def daemon_answers(client: str) -> bool:
    return subprocess.run([client, "info"], capture_output=True, timeout=60).returncode == 0


class DockerDaemon:
    """dockerd started for the test session, its output in `log`; stop() ends it (TERM, then KILL)."""

    def __init__(self, dockerd: str, log: Path):
        self.dockerd, self.log, self.proc = dockerd, log, None

    def start(self, client: str) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([self.dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if daemon_answers(client):
                return
            time.sleep(1)
        self.stop()
        pytest.fail(f"dockerd did not come up within {START_TIMEOUT_S} s (a Docker daemon is needed to build the "
                    f"images); its log {self.log}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and its containerd
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="session")
def docker(tmp_path_factory):
    client = docker_client()
    if client is None:
        pytest.fail("no Docker client that builds with BuildKit (docker with buildx, or Debian's docker.io): "
                    "install docker.io (`make test` does, as root)")
    if daemon_answers(client):
        yield client
        return
    dockerd = shutil.which("dockerd") or next((p for p in ("/usr/sbin/dockerd", "/usr/bin/dockerd")
                                               if os.access(p, os.X_OK)), None)
    if dockerd is None:
        pytest.fail(f"no Docker daemon reachable by {client} and no dockerd to start: install docker.io "
                    "(`make test` does, as root)")
    if os.geteuid() != 0:
        pytest.fail(f"no Docker daemon reachable by {client}, and starting dockerd needs root: start it "
                    "(e.g. `sudo dockerd &`) or run the tests as root")
    daemon = DockerDaemon(dockerd, tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    print(f"\nmds: no Docker daemon answered: started {dockerd} for this session (stopped at its end)")
    daemon.start(client)
    try:
        yield client
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def cpu_image(docker):
    """The default recipe built on the CPU base as CPU_TEST_IMAGE, once per session (the Docker tests run it,
    the SIF tests convert it); its build log."""
    code, log = make(docker, "image-cpu", f"IMAGE_CPU={CPU_TEST_IMAGE}")
    assert code == 0, log[-6000:]
    return log
