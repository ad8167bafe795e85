"""A throwaway `redis-server` on a free loopback port, no persistence: the fleet's Redis for the
bench's fleet section and the state machine's fleet rules (the tests keep their own in
tests/test_remote.py, which also runs against builds from before this package)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from .server import free_port


class RedisServer:
    """`redis-server --port P --bind 127.0.0.1 --save "" --appendonly no --dir WORK [extra]`; up when it
    accepts a connection (RuntimeError if not within `start_s`)."""

    def __init__(self, work: Path, extra: tuple[str, ...] = (), start_s: float = 10.0):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(work), *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None
