"""Fault injection for the reliability campaigns (`vllm-mlx-persist reliability`), off by default.

The store calls `store._FAULT(step)` before each system-call-level step of a write (`open`,
`write`, `fsync`, `rename`, `dirsync`) and of a read (`read`) when a hook is installed; with none
installed that is one global lookup. A hook is installed at import of `store` from the environment:

    VLLM_MLX_PERSIST_FAULT=kill@N              SIGKILL this process just before its Nth write step
    VLLM_MLX_PERSIST_FAULT=kill@N:dirsync      ... just before its Nth write step of that kind
    VLLM_MLX_PERSIST_FAULT=ENOSPC:write,fsync@/path/switch
                                                raise OSError(ENOSPC) at those steps while /path/switch exists
    VLLM_MLX_PERSIST_FAULT=sleep=1.5:read@/path/switch
                                                a slow disk: sleep 1.5 s before each of those steps while the switch exists
    VLLM_MLX_PERSIST_FAULT=hold:read@/path/switch
                                                a stuck disk: those steps wait until the switch is removed (polled),
                                                so a test decides when the I/O ends instead of timing it
    VLLM_MLX_PERSIST_FAULT='EIO:read@/a;ENOSPC:write@/b'   several, separated by ';'

Any errno name works (EIO, ENOSPC, EDQUOT, EROFS...). `kill@N` also writes one line to stderr
naming the step it killed at, so a campaign can say which points it hit.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

ENV = "VLLM_MLX_PERSIST_FAULT"
WRITE_STEPS = ("open", "write", "fsync", "rename", "dirsync")
STEPS = WRITE_STEPS + ("read",)


def parse(spec: str) -> Callable[[str], None]:
    """A hook for `spec` (see the module docstring); ValueError on a malformed spec."""
    if ";" in spec:
        hooks = [parse(part) for part in spec.split(";") if part]

        def all_of(step: str) -> None:
            for h in hooks:
                h(step)
        return all_of
    if spec.startswith("kill@"):
        n, _, kind = spec[5:].partition(":")
        if kind and kind not in WRITE_STEPS:
            raise ValueError(f"{ENV}={spec!r}: expected kill@N or kill@N:step (steps {WRITE_STEPS})")
        return _killer(int(n), kind or None)
    head, sep, switch = spec.partition("@")
    name, _, steps = head.partition(":")
    if name == "hold":
        wanted = set(steps.split(",")) if steps else set(STEPS)
        if not sep or not switch or not wanted <= set(STEPS):
            raise ValueError(f"{ENV}={spec!r}: expected hold:step,step@/switch/file (steps {STEPS})")
        return _holder(frozenset(wanted), switch)
    if name.startswith("sleep="):
        wanted = set(steps.split(",")) if steps else set(STEPS)
        if not sep or not switch or not wanted <= set(STEPS):
            raise ValueError(f"{ENV}={spec!r}: expected sleep=SECONDS:step,step@/switch/file (steps {STEPS})")
        return _sleeper(float(name[6:]), frozenset(wanted), switch)
    code = getattr(errno, name, None)
    wanted = set(steps.split(",")) if steps else set(STEPS)
    if not sep or not switch or not isinstance(code, int) or not wanted <= set(STEPS):
        raise ValueError(f"{ENV}={spec!r}: expected kill@N[:step] or ERRNO:step,step@/switch/file (steps {STEPS})")
    return _raiser(code, frozenset(wanted), switch)


def _killer(n: int, kind: Optional[str] = None) -> Callable[[str], None]:
    lock, count = threading.Lock(), [0]

    def hook(step: str) -> None:
        if step not in WRITE_STEPS or (kind is not None and step != kind):
            return
        with lock:
            count[0] += 1
            if count[0] == n:
                os.write(2, f"FAULT kill before write step {n} ({step})\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _raiser(code: int, steps: frozenset, switch: str) -> Callable[[str], None]:
    def hook(step: str) -> None:
        if step in steps and os.path.exists(switch):
            raise OSError(code, f"{os.strerror(code)} (injected at {step})")
    return hook


def _sleeper(seconds: float, steps: frozenset, switch: str) -> Callable[[str], None]:
    def hook(step: str) -> None:
        if step in steps and os.path.exists(switch):
            time.sleep(seconds)
    return hook


HOLD_POLL_S = 0.01


def _holder(steps: frozenset, switch: str) -> Callable[[str], None]:
    def hook(step: str) -> None:
        while step in steps and os.path.exists(switch):
            time.sleep(HOLD_POLL_S)
    return hook


def from_env() -> Optional[Callable[[str], None]]:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    hook = parse(spec)
    print(f"vllm-mlx-persist: fault injection ON ({ENV}={spec})", file=sys.stderr, flush=True)
    return hook
