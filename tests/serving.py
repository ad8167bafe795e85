"""Start and stop a real `vllm-mlx serve` subprocess for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

VLLM_MLX = str(Path(sys.executable).with_name("vllm-mlx"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm-mlx serve MODEL --continuous-batching [--cache-backend ...]` process."""

    def __init__(self, model_dir: Path, home: Path, *, backend: Optional[str] = "persist_q4",
                 options: Optional[dict] = None, extra_args: tuple[str, ...] = ()):
        self.model = str(model_dir)
        self.home = Path(home)
        self.backend = backend
        self.options = options or {}
        self.extra_args = extra_args
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.log_path = self.home / "server.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(HOME=str(self.home), XDG_CACHE_HOME=str(self.home / ".cache"), PYTHONUNBUFFERED="1")
        return env

    def command(self) -> list[str]:
        cmd = [VLLM_MLX, "serve", self.model, "--continuous-batching", "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra_args]
        if self.backend:
            cmd += ["--cache-backend", self.backend]
            if self.options:
                cmd += ["--cache-backend-options", json.dumps(self.options)]
        return cmd

    def start(self, timeout: float = 180) -> "Server":
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts}: {' '.join(self.command())}\n")
        log.flush()
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.3)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server did not become ready in {timeout}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc, self.proc = self.proc.returncode, None
        return rc

    def restart(self, sig: int = signal.SIGTERM) -> "Server":
        self.stop(sig)
        return self.start()

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
