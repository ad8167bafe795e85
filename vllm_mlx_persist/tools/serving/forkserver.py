"""Start `vllm-mlx serve` processes by forking one that has already imported vllm-mlx (the tests).

A server start takes ~3 s on a 2-core machine, ~2.2 s of it importing vllm_mlx.server (transformers,
mlx-lm, fastapi), and the test suite starts ~170 servers. The fork server pays the imports once and
forks a child per start; the child takes its own environment, working directory, stdio and argv and
runs vllm-mlx's own CLI entry point (`vllm_mlx.cli.main`), so each server is still a real, separate
process that the caller signals, kills and waits on as before (ForkedProcess: Popen's methods).

Only where that is the same process a fresh `vllm-mlx serve` would be:
- Linux (macOS forbids forking once its system frameworks are loaded);
- single-threaded until the fork: importing vllm-mlx starts no thread (MLX starts its stream thread at
  its first evaluation, in the child);
- one fork server per *import-time* environment: what libraries read when they load (LD_PRELOAD, the
  OpenBLAS and MLX settings, PYTHON*, ...) must equal the server's, so every variable except the ones
  read at run time (IMPORT_TIME_EXEMPT) is part of the key. Anything else starts a fresh process.

This file runs as the fork server itself (`python .../tools/serving/forkserver.py`): it imports only
the standard library at the top, so the fork server never imports our package (whose modules read
the environment when they load). server.py (Server) starts its servers through `spawn`.

Protocol (one line each, JSON requests on the fork server's stdin, answers on its stdout):
`{"id": ID, "argv": [...], "env": {...}, "cwd": "...", "log": "..."}` -> `pid ID N`; a child's end -> `exit N RC`
(RC as Popen.returncode: negative for a signal). EOF on stdin ends the fork server, and its children with
it (PR_SET_PDEATHSIG): a caller killed with -9, or stopped before it stopped its servers, leaves none
running.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import platform
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

ENV_SWITCH = "VLLM_MLX_PERSIST_FORKSERVER"  # "1": Server starts through a fork server (tests/conftest.py)
# Read at run time only (by vllm-mlx, our package, pytest), so they may differ between a fork
# server and its children: HOME and the cache dirs, vllm-mlx's and our settings, pytest's bookkeeping.
IMPORT_TIME_EXEMPT = ("HOME", "XDG_CACHE_HOME", "PYTEST_", "VLLM_MLX_")
LOST_STATUS = 255  # a child's return code where its fork server died before it (its real status is lost)
MAX_FORK_SERVERS = 3  # per process: distinct import-time environments kept warm (each ~300 MB)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH) == "1" and platform.system() == "Linux"


def _import_key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(IMPORT_TIME_EXEMPT)))


class _ChildState:
    __slots__ = ("returncode",)

    def __init__(self) -> None:
        self.returncode: Optional[int] = None


def _has_exited(pid: int) -> bool:
    """Whether the process has ended: a zombie its fork server has not reaped yet, or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


class ForkedProcess:
    """A server forked by a ForkServer: the part of subprocess.Popen that Server and its callers use
    (pid, returncode, poll, wait, send_signal, terminate, kill). Thread-safe."""

    def __init__(self, server: "ForkServer", pid: int, state: _ChildState, args: list[str]):
        self._server, self.pid, self._state, self.args = server, pid, state, args

    @property
    def returncode(self) -> Optional[int]:
        return self._state.returncode

    def poll(self) -> Optional[int]:
        if self._state.returncode is None and _has_exited(self.pid):
            try:  # as Popen.poll: ended means a return code; the fork server reports it within ms
                self.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return self._state.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """As Popen.wait. Where the fork server died first, nobody reports this child's status (its
        orphan is reaped by init): wait until /proc says it ended, and return LOST_STATUS."""
        deadline = None if timeout is None else time.monotonic() + timeout
        changed = self._server.changed
        with changed:
            changed.wait_for(lambda: self._state.returncode is not None or not self._server.alive, timeout)
        while self._state.returncode is None:
            if not self._server.alive and _has_exited(self.pid):
                with changed:
                    if self._state.returncode is None:
                        self._state.returncode = LOST_STATUS
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self._state.returncode

    def send_signal(self, sig: int) -> None:
        if self._state.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The caller's side of one fork server process (started with `env`, imports once)."""

    def __init__(self, env: dict, ready_timeout: float = 300):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.changed = threading.Condition()  # guards the three below; notified on every answer
        self._children: dict[int, _ChildState] = {}  # pid -> state, until the child's exit is read
        self._answers: dict[int, int] = {}  # request id -> pid, until spawn() takes it
        self.alive = True
        self._ids = itertools.count()
        self._write_lock = threading.Lock()  # one request line at a time on the pipe
        self._ready = threading.Event()
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        if not self._ready.wait(ready_timeout) or not self.alive:
            self.close()
            raise RuntimeError("the fork server did not start (see stderr)")

    def _read(self) -> None:
        """(reader thread) Apply the fork server's answers: `ready`, `pid ID N`, `exit N RC`."""
        for raw in self.proc.stdout:
            word, *rest = raw.decode().split()
            if word == "ready":
                self._ready.set()
                continue
            with self.changed:
                if word == "pid":
                    pid = int(rest[1])
                    self._children[pid] = _ChildState()  # a reused pid starts over: `pid` comes first
                    self._answers[int(rest[0])] = pid
                elif word == "exit":
                    state = self._children.pop(int(rest[0]), None)
                    if state is not None:
                        state.returncode = int(rest[1])
                self.changed.notify_all()
        with self.changed:  # the fork server is gone (its children live on, unwatched)
            self.alive = False
            self.changed.notify_all()
        self._ready.set()

    def spawn(self, argv: list[str], env: dict, log_path: str, cwd: Optional[str] = None) -> ForkedProcess:
        """Fork a child that runs `argv` (vllm-mlx's CLI) with `env`, stdout and stderr appended to
        `log_path`."""
        rid = next(self._ids)
        request = json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd or os.getcwd(), "log": log_path})
        with self._write_lock:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: rid in self._answers or not self.alive, 60) \
                    or rid not in self._answers:
                raise RuntimeError("the fork server did not answer")
            pid = self._answers.pop(rid)
            return ForkedProcess(self, pid, self._children[pid], argv)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Slot:
    """A fork server being started (ready unset) or started (server None where it failed)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.server: Optional[ForkServer] = None


_slots: dict[tuple, _Slot] = {}  # import-time environment -> its fork server
_slots_lock = threading.Lock()  # guards _slots only (never held while a fork server starts)


def spawn(argv: list[str], env: dict, log_path: str) -> Optional[ForkedProcess]:
    """Start `argv` through this process's fork server for `env`'s import-time part (started on first
    use); None where none can be had (then start a fresh process)."""
    key = _import_key(env)
    with _slots_lock:
        slot = _slots.get(key)
        if slot is not None and slot.ready.is_set() and (slot.server is None or not slot.server.alive):
            slot = None  # failed or gone: one more try
        starter = slot is None
        if starter:
            if len(_slots) >= MAX_FORK_SERVERS and key not in _slots:
                return None
            slot = _slots[key] = _Slot()
    if starter:
        server_env = dict(env)
        for name in ("HOME", "XDG_CACHE_HOME"):
            if name in os.environ:
                server_env[name] = os.environ[name]
        try:
            slot.server = ForkServer(server_env)
        except (RuntimeError, OSError):
            pass
        finally:
            slot.ready.set()
    slot.ready.wait()
    if slot.server is None:
        return None
    try:
        return slot.server.spawn(argv, env, log_path)
    except (RuntimeError, OSError):
        return None


@atexit.register
def _close_all() -> None:
    for slot in list(_slots.values()):
        if slot.server is not None:
            slot.server.close()


# ---- the fork server process ----

def _child(request: dict, status_out, parent: int) -> None:
    """(forked child) Become the server: never returns, exits the way `vllm-mlx serve` exits
    (SystemExit through the interpreter's normal shutdown, atexit handlers included), or is killed
    when the fork server `parent` ends."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the fork server
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    status_out.close()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # let go of the fork server's pipes first: its reader must see EOF when it dies
        os.dup2(null, fd)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    from vllm_mlx.cli import main

    sys.exit(main())


def _serve() -> None:
    import gc

    import vllm_mlx.cli  # noqa: F401  the imports every child would otherwise pay
    import vllm_mlx.server  # noqa: F401

    gc.freeze()  # keep the imported objects out of the children's collections (fewer copied pages)
    status_out = os.fdopen(os.dup(1), "w", buffering=1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status_out.write("ready\n")
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:  # reap every child that has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            status_out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        if 0 in readable:
            data = os.read(0, 1 << 20)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                parent = os.getpid()
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(request, status_out, parent)
                status_out.write(f"pid {request['id']} {pid}\n")


if __name__ == "__main__":
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder's modules (server.py, ...) are no top-level modules of the servers
    _serve()
