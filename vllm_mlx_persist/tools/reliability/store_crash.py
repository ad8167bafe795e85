"""`vllm-mlx-persist reliability --campaigns crash`: a subprocess runs the real DiskStore writing agents'
blocks and manifests (printing an ACK once a turn's manifest is durable) and is SIGKILLed, half the trials
just before a chosen write step (the store's fault hook), half at a random moment; the store is then
reopened as a server start does (open, gc) and checked: every acknowledged turn is fully readable, every
file there reads back exactly, no temp file and no unreferenced block survives the start.

`python -m vllm_mlx_persist.tools.reliability.store_crash ROOT TURNS` is that subprocess (the writer)
when it cannot be forked.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ... import faults
from ...disk_format import Manifest
from ...store import DiskStore, StoreError
from .store_blocks import FP, INFO, block_for, same_block


_MODULE = "vllm_mlx_persist.tools.reliability.store_crash"  # not __name__: that is __main__ under -m
WINDOW = 8  # a crash-campaign manifest names its agent's last WINDOW blocks


def _crash_id(agent: str, turn: int) -> str:
    return hashlib.sha256(f"{agent}:{turn}".encode()).hexdigest()


def _crash_ids(agent: str, turn: int) -> list[str]:
    return [_crash_id(agent, t) for t in range(max(0, turn - WINDOW + 1), turn + 1)]


def _crash_worker(root: str, start: str) -> None:
    """Child: write turns round-robin until killed; print ACK after each durable manifest."""
    store = DiskStore(Path(root), FP, *INFO)
    turns = json.loads(start)
    print("READY", flush=True)
    agents = sorted(turns)
    i = 0
    while True:
        agent = agents[i % len(agents)]
        turn = turns[agent] + 1
        store.write_block(block_for(_crash_id(agent, turn)))
        store.write_manifest(Manifest(agent, _crash_ids(agent, turn), turn + 1, time.time()))
        turns[agent] = turn
        print(f"ACK {agent} {turn}", flush=True)
        i += 1


class _Worker:
    """The crash writer in a child process, stdout and stderr on one pipe. Forked from this process
    (no interpreter start-up: ~5x more trials per second) unless MLX is loaded here (forking after
    Metal is initialised is unsafe), else a fresh interpreter; either way killed with SIGKILL."""

    def __init__(self, root: Path, acked: dict, point: Optional[str]):
        from ... import store as store_mod

        self.proc: Optional[subprocess.Popen] = None
        if hasattr(os, "fork") and "mlx.core" not in sys.modules:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # child: never returns into the campaign
                try:
                    os.close(r)
                    os.dup2(w, 1)
                    os.dup2(w, 2)
                    sys.stdout = os.fdopen(1, "w", buffering=1)
                    store_mod._FAULT = faults.parse(f"kill@{point}") if point else None
                    _crash_worker(str(root), json.dumps(acked))
                finally:
                    os._exit(0)
            os.close(w)
            self.pid, self.stdout, self.returncode = pid, os.fdopen(r), None
            return
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(faults.ENV, None)
        if point:
            env[faults.ENV] = f"kill@{point}"
        self.proc = subprocess.Popen([sys.executable, "-m", _MODULE, str(root), json.dumps(acked)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.pid, self.stdout = self.proc.pid, self.proc.stdout

    def poll(self) -> Optional[int]:
        if self.proc is not None:
            return self.proc.poll()
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired("crash-worker", timeout)
            time.sleep(0.002)
        return self.returncode if self.proc is None else self.proc.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


DET_STEPS = 40  # deterministic kill points cycle over the first 40 write steps (~3 turns of syscalls)


def det_point(k: int) -> str:
    """The kill point of the kth deterministic trial: `N:kind`, the Nth write step of that kind,
    kinds in turn (open, write, fsync, rename, dir fsync), N cycling over 1..DET_STEPS/5. Counted per
    kind, every kind is hit whatever the writer's start-up writes (a count over all steps shifts
    with what earlier trials left in the store: one run in several missed dirsync)."""
    kinds = faults.WRITE_STEPS
    return f"{1 + (k // len(kinds)) % (DET_STEPS // len(kinds))}:{kinds[k % len(kinds)]}"


def crash_campaign(trials: int, seed: int, work: Path, n_agents: int = 4) -> dict:
    """Even trials SIGKILL the writer deterministically just before a chosen write step (open, write,
    fsync, rename, dir fsync: the store's fault hook, faults.py; det_point); odd trials SIGKILL it
    from outside at a random moment."""
    rng = random.Random(seed)
    root = work / "crash"
    acked = {f"agent-{k}": -1 for k in range(n_agents)}
    failures: list[dict] = []
    stats: dict[str, Any] = {"acked_turns": 0, "killed_before_ready": 0, "tmp_removed": 0, "orphans_removed": 0,
                             "deterministic_trials": 0, "points": {}}
    for trial in range(trials):
        point = det_point(trial // 2) if trial % 2 == 0 else None
        delay = rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.05), rng.uniform(0, 0.3)])
        proc = _Worker(root, acked, point)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        if point is not None:
            try:
                proc.wait(60)  # it kills itself at the point
            except subprocess.TimeoutExpired:
                failures.append({"trial": trial, "seed": seed, "point": point,
                                 "problems": ["the writer never reached its kill point"]})
        else:
            deadline = time.time() + 60
            while not lines and time.time() < deadline and proc.poll() is None:
                time.sleep(0.001)
            if rng.random() < 0.05:  # sometimes during start-up itself
                stats["killed_before_ready"] += 1
            else:
                time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(10)
        if point is not None:
            hit = [e.split("(")[-1].rstrip(")\n") for e in lines if e.startswith("FAULT kill")]
            if hit:
                stats["deterministic_trials"] += 1
                stats["points"][hit[0]] = stats["points"].get(hit[0], 0) + 1
        for line in lines:
            if line.startswith("ACK "):
                _, agent, turn = line.split()
                acked[agent] = max(acked[agent], int(turn))
                stats["acked_turns"] += 1
        problems = _check_after_crash(root, acked, stats)
        if problems:
            failures.append({"trial": trial, "seed": seed, "point": point, "delay_s": round(delay, 6),
                             "problems": problems[:5]})
    if stats["acked_turns"] == 0:  # a campaign that checked nothing must not pass
        failures.append({"seed": seed, "problems": ["no turn was ever acknowledged: the writer never ran"]})
    if trials >= 40 and \
            set(stats["points"]) != {"open", "write", "fsync", "rename", "dirsync"}:
        failures.append({"seed": seed, "problems": [f"deterministic kills hit only {sorted(stats['points'])}"]})
    return {"trials": trials, "failures": len(failures), "failure_cases": failures[:20], **stats}


def _check_after_crash(root: Path, acked: dict[str, int], stats: dict) -> list[str]:
    problems = []
    model_dir = root / FP[:32]
    tmp_before = len(os.listdir(model_dir / "tmp")) if (model_dir / "tmp").is_dir() else 0
    try:
        store = DiskStore(root, FP, *INFO)  # a start: stale tmp files of the dead writer go
    except StoreError as e:
        return [f"reopen refused: {e}"]
    stats["tmp_removed"] += tmp_before - len(os.listdir(store.tmp_dir))
    if os.listdir(store.tmp_dir):
        problems.append(f"tmp files survived the start: {os.listdir(store.tmp_dir)}")
    manifests = {m.namespace: m for m in store.list_manifests()}
    stats["orphans_removed"] += store.gc(set())  # as BlockPool.load_manifests does
    for agent, turn in acked.items():
        if turn < 0:
            continue
        m = manifests.get(agent)
        if m is None or m.n_tokens - 1 < turn:
            problems.append(f"{agent}: acknowledged turn {turn} lost (manifest {m and m.n_tokens - 1})")
    for m in manifests.values():
        if m.block_ids != _crash_ids(m.namespace, m.n_tokens - 1):
            problems.append(f"{m.namespace}: manifest names the wrong blocks")
        for bid in m.block_ids:
            got = store.read_block(bid)
            if got is None or not same_block(got, block_for(bid)):
                problems.append(f"{m.namespace}: block {bid[:12]} of turn {m.n_tokens - 1} unreadable or wrong")
    named = {b for m in manifests.values() for b in m.block_ids}
    orphans = set(store.iter_block_ids()) - named
    if orphans:
        problems.append(f"{len(orphans)} unreferenced block file(s) survived the start")
    if os.listdir(store.quarantine_dir):
        problems.append(f"files quarantined after a crash: {os.listdir(store.quarantine_dir)[:3]}")
    return problems


if __name__ == "__main__":
    _crash_worker(sys.argv[1], sys.argv[2])
