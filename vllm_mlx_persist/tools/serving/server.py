"""Start, stop and watch one real `vllm-mlx serve` subprocess: what every tool (`vllm-mlx-persist
bench`, `quality`, `reliability`) and the tests start their servers with.

With VLLM_MLX_PERSIST_FORKSERVER=1 (the tests) the process is forked from one that has already
imported vllm-mlx (forkserver.py beside this file): the same server, without paying its ~2 s of
imports per start.

Each server gets its own HOME (vllm-mlx writes its prefix cache under ~/.cache on SIGTERM) and, on
Linux, Debian's OpenBLAS preloaded when present (machine.openblas_path).
"""

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
from typing import Optional, Union

from . import forkserver
from .machine import openblas_path

VLLM_MLX = str(Path(sys.executable).with_name("vllm-mlx"))


def free_port() -> int:
    """A local TCP port nobody listens on now (someone may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm-mlx serve MODEL --continuous-batching [--cache-backend ...] [extra args]` process."""

    def __init__(self, model_dir: Path, home: Path, *, backend: Optional[str] = "persist_q4",
                 options: Optional[dict] = None, extra_args: tuple[str, ...] = (), openblas: bool = True,
                 env: Optional[dict] = None):
        self.model = str(model_dir)
        self.home = Path(home)
        self.backend = backend
        self.options = options or {}
        self.extra_args = tuple(extra_args)
        self.blas = openblas_path() if openblas else None
        self.extra_env = dict(env or {})  # e.g. VLLM_MLX_PERSIST_FAULT for the reliability campaigns
        self.proc: Optional[Union[subprocess.Popen, forkserver.ForkedProcess]] = None
        self.port = 0
        self.log_path = self.home / "server.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(HOME=str(self.home), XDG_CACHE_HOME=str(self.home / ".cache"), PYTHONUNBUFFERED="1")
        env.update(self.extra_env)
        if self.blas and self.blas not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = self.blas + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        return env

    def command(self) -> list[str]:
        cmd = [VLLM_MLX, "serve", self.model, "--continuous-batching", "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra_args]
        if self.backend:
            cmd += ["--cache-backend", self.backend]
            if self.options:
                cmd += ["--cache-backend-options", json.dumps(self.options)]
        return cmd

    def start(self, timeout: float = 180, bind_attempts: int = 3) -> "Server":
        """Start the server on a free port and wait until /health answers and the log says this server
        bound the port. The port is free when picked, but another process (a parallel test, another
        campaign) may take it before the server binds it seconds later, and answer /health meanwhile:
        then the server is started again on another port, up to `bind_attempts`."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.starts += 1
        command, env = self.command(), self.env()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== start {self.starts}: {' '.join(command)}\n")
            log.flush()
            start_of_log = log.tell()
            self.proc = forkserver.spawn(command, env, str(self.log_path)) if forkserver.enabled() else None
            if self.proc is None:
                self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if bind_attempts > 1 and "address already in use" in self._log_since(start_of_log):
                    self.proc = None
                    return self.start(max(1.0, deadline - time.time()), bind_attempts - 1)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    # Ours, not another server that took the port first (ours then fails to bind and
                    # exits): uvicorn logs the address once it is bound.
                    if r.status == 200 and f"running on {self.url}" in self._log_since(start_of_log):
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
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

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace").lower()
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
