"""Start, wait for and stop real `moeserve serve` processes in tests (never left running)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.tiny_checkpoints import YARN, make_checkpoint

SERVING = re.compile(r"serving .* on (http://[\w.\[\]:]+:\d+) \(engine process pid (\d+)")
API_KEY = "test-key"


def make_serve_checkpoint(path: Path) -> Path:
    """The tiny V3 checkpoint with a 4096-token context, so that long requests outlast a test's actions."""
    rope = {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024}
    return make_checkpoint(path, "v3", max_position_embeddings=4096, rope_parameters=rope)


@dataclass
class ServerProcess:
    """A running server: its process, log file, base URL and engine pid."""

    proc: subprocess.Popen
    log_path: Path
    url: str = ""
    engine_pid: int = 0
    health_seen: list[int] = field(default_factory=list)

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Terminate the server and everything it started; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        # The server runs in its own session: kill its group (the engine process included).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.engine_pid and engine_alive(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)
        self.proc.wait(timeout=15)


def engine_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def start_server(model: Path | None, log_path: Path, *args: str, ready: bool = True, timeout: float = 120) -> ServerProcess:
    """Start `moeserve serve` on a free port; wait until it listens (and, with `ready`, is healthy)."""
    cmd = [
        sys.executable, "-m", "moeserve", "serve", *(["--model", str(model)] if model else []),
        "--device", "cpu", "--dtype", "float32",
        "--port", "0", "--max-num-seqs", "64", "--log-level", "warning", *args,
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (the child writes it; closed with the test's tmp dir)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while not server.url:
            m = SERVING.search(server.log())
            if m:
                server.url, server.engine_pid = m.group(1), int(m.group(2))
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{server.log()}")
            else:
                time.sleep(0.05)
        if ready:
            wait_healthy(server, deadline)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server: ServerProcess, deadline: float) -> None:
    """Poll /health until 200, recording the statuses seen on the way."""
    while True:
        try:
            status = httpx.get(server.url + "/health", timeout=5).status_code
            server.health_seen.append(status)
            if status == 200:
                return
        except httpx.TransportError:
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server never became healthy:\n{server.log()}")
        time.sleep(0.05)


def metric_value(url: str, name: str, labels: str = "") -> float:
    """One sample of /metrics (summed over series whose labels contain `labels`)."""
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and labels in line or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def wait_for(predicate, timeout: float = 30, interval: float = 0.1) -> bool:
    """Poll until `predicate()` holds; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
