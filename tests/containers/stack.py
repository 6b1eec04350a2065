"""The compose stack under test: testcontainers' DockerCompose over the repository's docker-compose.yml, with
the settings of the test in an env file (project name, image tag, models, published port), and waits that fail
fast, with the logs, when a container exits or never becomes healthy."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import docker
from testcontainers.compose import ComposeContainer, DockerCompose

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT_PREFIX = "kvmesh-test-"  # + the pytest process id, so concurrent runs do not meet
API_KEY = "sk-kvmesh-containers-test"
ONE_SHOT = ("models", "certs")  # services that do their job and exit 0: the model pull, the certificates
SETTINGS = {
    "KVMESH_IMAGE": "kvmesh:test",  # leaves a user's kvmesh:latest alone
    "KVMESH_API_KEYS": API_KEY,
    "KVMESH_MODELS": "deepseek-tiny",  # made locally (no download) and the fastest to load and run
    "KVMESH_PUBLISH": "127.0.0.1:",  # "127.0.0.1::8080": a free port on loopback only
    "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",  # a dead worker leaves its pool within 1.5 s
    "KVMESH_KV_CACHE_MEMORY_BYTES": str(64 * 2**20),
    "KVMESH_LOG_FORMAT": "json",
}


class StackError(RuntimeError):
    pass


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.project = f"{PROJECT_PREFIX}{os.getpid()}"
        self.workdir = workdir
        env_file = workdir / "stack.env"
        env_file.write_text(
            "".join(f"{k}={v}\n" for k, v in {"COMPOSE_PROJECT_NAME": self.project, **SETTINGS}.items())
        )
        self.compose = DockerCompose(
            REPO_ROOT, compose_file_name="docker-compose.yml", env_file=str(env_file), build=True, wait=False
        )
        self.docker = docker.from_env()
        self.base_url = ""

    def up(self, timeout_s: float) -> None:
        """Build the image (once: the models service builds it), start everything, wait until healthy."""
        remove_stale_stacks(self.compose)
        try:
            self.compose.start()
        except subprocess.CalledProcessError as exc:
            raise StackError(f"`{' '.join(exc.cmd)}` failed:\n{exc.stderr.decode(errors='replace')[-4000:]}") from exc
        self.wait_healthy({"nats": 1, "gateway": 1, "prefill": 1, "decode": 1, "kvcache": 1, "balancer": 2}, timeout_s)
        host, port = self.compose.get_service_host_and_port("gateway", 8080)
        self.base_url = f"http://{host}:{port}"

    def scale(self, timeout_s: float, **counts: int) -> None:
        flags = [arg for service, n in counts.items() for arg in ("--scale", f"{service}={n}")]
        self.run("up", "--detach", "--no-build", "--no-recreate", *flags)
        expected = {"nats": 1, "gateway": 1, "prefill": 1, "decode": 1, "kvcache": 1, "balancer": 2, **counts}
        self.wait_healthy(expected, timeout_s)

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "10")

    def run(self, *args: str) -> str:
        result = subprocess.run(
            [*self.compose.docker_compose_command(), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
        )
        if result.returncode != 0:
            raise StackError(f"docker compose {' '.join(args)} failed:\n{result.stderr[-4000:]}")
        return result.stdout

    def running(self, service: str) -> list[ComposeContainer]:
        return sorted(
            (c for c in self.compose.get_containers() if c.Service == service and c.State == "running"),
            key=lambda c: c.Name or "",
        )

    def container(self, compose_container: ComposeContainer):
        return self.docker.containers.get(compose_container.ID)

    def wait_healthy(self, expected: dict[str, int], timeout_s: float) -> None:
        """Until each service has `expected[service]` running, healthy containers; fails at once if one exits
        with an error or restarts, and after `timeout_s` otherwise, with the logs either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            containers = self.compose.get_containers(include_all=True)
            broken = [
                c
                for c in containers
                if c.State == "restarting" or (c.State == "exited" and (c.Service not in ONE_SHOT or c.ExitCode != 0))
            ]
            if broken:
                names = ", ".join(f"{c.Name} ({c.State}, exit {c.ExitCode})" for c in broken)
                raise StackError(f"containers failed: {names}\n{self.logs_tail()}")
            healthy = Counter(c.Service for c in containers if c.State == "running" and c.Health == "healthy")
            if all(healthy[service] == n for service, n in expected.items()):
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"not healthy after {timeout_s:.0f}s: {dict(healthy)} of {expected}\n{self.logs_tail()}"
                )
            time.sleep(1.0)

    def save_logs(self) -> Path | None:
        """Every container's output, saved beside the env file (None if compose could not give it)."""
        try:
            logs = self.run("logs", "--no-color", "--timestamps")
        except (StackError, subprocess.SubprocessError):
            return None
        path = self.workdir / "stack.log"
        path.write_text(logs)
        return path

    def logs_tail(self, chars: int = 6000) -> str:
        path = self.save_logs()
        return f"(full logs: {path})\n{path.read_text()[-chars:]}" if path else "(no logs)"


def remove_stale_stacks(compose: DockerCompose) -> None:
    """Take down test stacks whose pytest process is gone (a run that was killed leaves its containers)."""
    client = docker.from_env()
    projects = {
        c.labels.get("com.docker.compose.project", "")
        for c in client.containers.list(all=True, filters={"label": "com.docker.compose.project"})
    }
    for project in sorted(p for p in projects if p.startswith(PROJECT_PREFIX)):
        pid = project.removeprefix(PROJECT_PREFIX)
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            subprocess.run(
                [
                    *compose.docker_compose_command(),
                    "-p",
                    project,
                    "down",
                    "--volumes",
                    "--remove-orphans",
                    "--timeout",
                    "0",
                ],
                cwd=REPO_ROOT,
                capture_output=True,
                timeout=300,
            )
