"""What the pool's state machine drives the real pool with: the synthetic K/V of its token histories,
pools opened on a temporary store (with a throwaway redis-server for the fleet tier), the clocks its
rules move, store fault hooks that hold, fail or kill a write step, and the watchdog every pool
operation runs under.

K/V are synthetic but go through the real 4-bit code: token t's K and V are drawn from a seed that
hashes the whole history up to t (as a real model's depend on everything before), quantized by
`Q4KVCache`. So a prefix served from another agent's or another branch's history has other bytes. A
splice's K/V are drawn from another seed from the splice point on (its moved keys are rotated, and
what follows is prefilled on them), so a spliced branch served to an exact lookup has other bytes too.

Used by pool_model.py, fleet_rules.py and pool_machine.py: tests/test_state_machine.py and
`vllm-mlx-persist reliability --campaigns state_machine` (or `fleet`) enter them. Never imported by the
runtime.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from ... import faults
from ...caches.q4 import Q4KVCache
from ...pool import BlockPool
from ...store import DiskStore

OP_TIMEOUT_S = 60.0  # any pool operation slower than this is a hang
BITS, GROUP, BLOCK, HEADS, DIM, LAYERS = 4, 64, 8, 2, 64, 2
TOKEN_BYTES = LAYERS * 2 * HEADS * (DIM * BITS // 8 + 2 * 4 * DIM // GROUP)  # 4-bit K+V per token
FINGERPRINT = "machine" + "0" * 57
AGENTS = ("a", "b", "c", "d")
WORDS = tuple(range(20, 40))  # ordinary tokens: a distinct word each
# Tokens 5..9 spell "a", "b", "ab", "c", "bc": [7] and [5, 6] are the same text, as are [5, 9] and [7, 8].
TEXT = {5: "a", 6: "b", 7: "ab", 8: "c", 9: "bc"}
RETOKENIZE = {(7,): (5, 6), (7, 8): (5, 9)}
TTL_S = 3600.0
BRANCHES = 3  # the pools' `branches`
GONE_KEPT = 4  # histories an erasure or a forget removed, kept per agent to be sent again


def decode(ids: list[int]) -> str:
    return "".join(TEXT.get(int(i), f" w{int(i)}") for i in ids)


class SyntheticKV:
    """K/V of a token history: per token, drawn from a seed hashing every token up to it; a splice's
    from another seed (`spliced`: per token, whether its K/V are a splice's)."""

    def __init__(self) -> None:
        self._memo: dict[bytes, np.ndarray] = {}

    def _rows(self, tokens: Sequence[int], salt: bytes) -> list[np.ndarray]:
        h = hashlib.sha256(salt)
        rows = []
        for t in tokens:
            h.update(int(t).to_bytes(4, "little"))
            key = h.digest()
            row = self._memo.get(key)
            if row is None:
                rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
                row = rng.standard_normal((2, LAYERS, HEADS, DIM), dtype=np.float32)
                if len(self._memo) > 200_000:
                    self._memo.clear()
                self._memo[key] = row
            rows.append(row)
        return rows

    def arrays(self, tokens: Sequence[int], spliced: Optional[Sequence[bool]] = None) -> tuple[np.ndarray, np.ndarray]:
        """(K, V), each (LAYERS, 1, HEADS, len(tokens), DIM) float32."""
        rows = self._rows(tokens, b"synthetic-kv")
        if spliced is not None and any(spliced):
            other = self._rows(tokens, b"spliced-kv")
            rows = [o if s else r for r, o, s in zip(rows, other, spliced)]
        kv = np.stack(rows, axis=3) if rows else np.zeros((2, LAYERS, HEADS, 0, DIM), np.float32)
        return kv[0][:, None], kv[1][:, None]

    def cache(self, tokens: Sequence[int], spliced: Optional[Sequence[bool]] = None) -> list[Q4KVCache]:
        """A per-sequence 4-bit cache holding `tokens`, as a prefill (or a splice) would store it."""
        k, v = self.arrays(tokens, spliced)
        out = []
        for layer in range(LAYERS):
            c = Q4KVCache(group_size=GROUP, bits=BITS)
            c.update_and_fetch(mx.array(k[layer]), mx.array(v[layer]))
            out.append(c)
        mx.eval([a for c in out for part in c.to_arrays() for a in part])
        return out


def same_cache(a: list, b: list) -> bool:
    for x, y in zip(a, b):
        for px, py in zip(x.to_arrays(), y.to_arrays()):
            for ax, ay in zip(px, py):
                if ax.shape != ay.shape or not mx.array_equal(ax, ay).item():
                    return False
    return len(a) == len(b)


def spliced_mask(cache: list, kv: SyntheticKV, tokens: Sequence[int]) -> Optional[list[bool]]:
    """Per token of a served cache: False where its K/V are a prefill's, True where a splice's; None
    when some token's are neither. mlx quantizes each token on its own, so tokens compare apart."""
    honest, spliced = kv.cache(tokens), kv.cache(tokens, [True] * len(tokens))
    if len(cache) != len(honest):
        return None
    eq_h = eq_s = mx.ones((len(tokens),), dtype=mx.bool_)
    for c, h, s in zip(cache, honest, spliced):
        for pc, ph, ps in zip(c.to_arrays(), h.to_arrays(), s.to_arrays()):
            for ac, ah, as_ in zip(pc, ph, ps):
                if ac.shape != ah.shape:
                    return None
                eq_h = eq_h & mx.all(ac == ah, axis=(0, 1, 3))
                eq_s = eq_s & mx.all(ac == as_, axis=(0, 1, 3))
    h, s = np.array(eq_h), np.array(eq_s)
    if not (h | s).all():
        return None
    return [not bool(x) for x in h]


_WORKER = ThreadPoolExecutor(1, thread_name_prefix="machine-worker")  # vllm-mlx's worker: the one MLX thread
ADMIN = ThreadPoolExecutor(1, thread_name_prefix="machine-admin")  # an admin API call that waits for the disk


def watchdog(fn: Callable, *args: Any, timeout: float = OP_TIMEOUT_S, **kw: Any) -> Any:
    """fn(*args) on the machine's worker thread (MLX streams are per thread, and the pool's MLX work
    runs on one thread, as in the server); AssertionError if it does not return within `timeout`."""
    future = _WORKER.submit(fn, *args, **kw)
    try:
        return future.result(timeout)
    except FutureTimeout:
        raise AssertionError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout} s (a hang)") from None


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Clock:
    """Wall-clock time that a rule can move on (the TTL's)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


# A server's clock is the machine's wall clock stepped by one of these (seconds): a rule steps each
# server's clock back and forward, so the servers disagree by up to CLOCK_SPAN.
CLOCK_STEPS = (-120.0, -60.0, 0.0, 60.0, 120.0)
CLOCK_SPAN = max(CLOCK_STEPS) - min(CLOCK_STEPS)


class ServerClock:
    """One server's clock: the wall clock (`Clock`) stepped by `step` seconds."""

    def __init__(self, wall: Clock) -> None:
        self.wall, self.step = wall, 0.0

    def __call__(self) -> float:
        return self.wall() + self.step


class Gate:
    """A store fault hook (store._FAULT, faults.py's seam) that holds the first thread to reach a write
    step after it is installed (the persister, inside the save it is writing: every job queued after
    stays queued) until `open()`; `fail`: that step then fails (EIO), so the save is retried later.
    Every other thread passes."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.held = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.fail = False

    def __call__(self, step: str) -> None:
        if step not in faults.WRITE_STEPS or self._open.is_set():
            return
        with self._lock:
            if self.thread is None:
                self.thread = threading.current_thread()
            if self.thread is not threading.current_thread():
                return
        self.held.set()
        self._open.wait(OP_TIMEOUT_S)
        if self.fail:
            self.fail = False
            raise OSError(errno.EIO, f"held at {step}, then failed (injected)")

    def open(self) -> None:
        self._open.set()


class KillAt:
    """A store fault hook: the process is killed just before its `n`th write step. In process: the store
    directory is copied as it is then (all the disk's writers are the persister thread, which is here),
    which is what a SIGKILL there would leave for the restart; that step and every later write fail."""

    def __init__(self, n: int, root: Path, copy: Path):
        self.n, self.root, self.copy = n, root, copy
        self.count = 0
        self.killed: Optional[str] = None  # the step it was killed before
        self._lock = threading.Lock()

    def __call__(self, step: str) -> None:
        if step not in faults.WRITE_STEPS:
            return
        with self._lock:
            self.count += 1
            if self.count == self.n:
                shutil.copytree(self.root, self.copy, symlinks=True)
                self.killed = step
            if self.killed is not None:
                raise OSError(errno.EIO, f"killed before write step {self.n} ({self.killed})")


# The machine's tiers give up on an unreachable Redis fast: a partition (a cut proxy) costs a step
# a fraction of a second, and a healed one is reached again within FLEET_BREAKER_S.
FLEET_BREAKER_S = 0.1
FLEET_SETTINGS = {"wait_s": 10.0, "breaker_open_s": FLEET_BREAKER_S, "backoff_s": 0.02, "backoff_max_s": 0.1,
                  "max_attempts": 2, "read_timeout_s": 2.0}


def open_pool(root: Path, *, hot: int, disk: int, clock: Callable[[], float], redis_url: Optional[str] = None,
              retry_delays: tuple = (0.05,)) -> BlockPool:
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fleet = None
    if redis_url is not None:
        from ...fleet import Fleet, FleetSettings, RemoteTier

        def fleet(pool: BlockPool) -> Fleet:
            return Fleet(pool, lambda **cb: RemoteTier(FleetSettings(redis_url, **FLEET_SETTINGS), FINGERPRINT, **cb))
    pool = BlockPool(fingerprint=FINGERPRINT, n_layers=LAYERS, bits=BITS, group_size=GROUP, block_size=BLOCK,
                     hot_bytes=hot, store=DiskStore(root, FINGERPRINT, {"machine": True}, fmt), disk_budget=disk,
                     persister_options={"ttl_s": TTL_S, "retry_delays": retry_delays},
                     branches=BRANCHES, decode=decode, fleet=fleet, clock=clock)
    pool.load_manifests()
    pool.flush()  # the start-up scan (sizes, garbage collection, the first budget and TTL check) is done
    return pool



# The hot and disk budgets a rule sets (the first: as good as none).
HOT_BUDGETS = (1 << 30, 40 * TOKEN_BYTES, 120 * TOKEN_BYTES)
DISK_BUDGETS = (1 << 40, 200 * TOKEN_BYTES, 600 * TOKEN_BYTES)
# What the rules draw: an agent, and the new tokens of a turn.
names = st.sampled_from(AGENTS)
words = st.lists(st.sampled_from(WORDS + (7, 8, 7, 8)), min_size=1, max_size=24)
