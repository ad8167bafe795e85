"""Reliability campaigns against the real store: crash points and fuzzed files.

    vllm-mlx-persist reliability [--quick] [--campaigns crash,fuzz] [--out docs]

crash: a subprocess runs the real DiskStore writing agents' blocks and manifests (printing an ACK
once a turn's manifest is durable) and is SIGKILLed at a random moment; the store is then reopened
as a server start does (open, gc) and checked: every acknowledged turn is fully readable, every file
there reads back exactly, no temp file and no unreferenced block survives the start.

fuzz: a store of agents built with the pool's chained block ids gets one mutation per trial (bit
flips, truncation, forged tokens with a recomputed checksum, swapped blocks, foreign manifests,
links, FIFOs, directories, huge or negative numbers, invalid or deeply nested JSON) and is reopened
and read as the pool reads it; each outcome is classified quarantined / ignored / refused, and any
crash, hang or damaged or foreign KV served is a failure.

The campaigns against a real server (server_crash, disk, storm, soak, interactions) are in
server_campaigns.py.

Figures, the command and the machine go to <out>/reliability.md and <out>/reliability.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ... import faults
from ...disk_format import BlockData, Manifest
from ...store import DiskStore, StoreError

FP = "c0" * 32
_MODULE = "vllm_mlx_persist.tools.reliability.main"  # not __name__: that is __main__ under -m
WINDOW = 8  # a crash-campaign manifest names its agent's last WINDOW blocks
_INFO = ({"tool": "reliability"}, {"bits": 4})


def _block(bid: str, n_tokens: int = 16, kib: int = 64) -> BlockData:
    """Deterministic content for an id: anyone can regenerate and compare it."""
    rng = np.random.default_rng(int(bid[:16], 16))
    words = kib * 256 // 2
    arrays = {f"{l}.{p}": rng.integers(0, 2**32, size=(1, 2, n_tokens, max(1, words // (2 * n_tokens))),
                                       dtype=np.uint32) for l in range(2) for p in ("k.q", "v.q")}
    return BlockData(bid, rng.integers(0, 50_000, size=n_tokens, dtype=np.int32), arrays)


def _same(a: BlockData, b: BlockData) -> bool:
    return (a.block_id == b.block_id and np.array_equal(a.tokens, b.tokens) and a.arrays.keys() == b.arrays.keys()
            and all(a.arrays[k].tobytes() == b.arrays[k].tobytes() for k in a.arrays))


# ---------------------------------------------------------------------------------------------
# crash points


def _crash_id(agent: str, turn: int) -> str:
    return hashlib.sha256(f"{agent}:{turn}".encode()).hexdigest()


def _crash_ids(agent: str, turn: int) -> list[str]:
    return [_crash_id(agent, t) for t in range(max(0, turn - WINDOW + 1), turn + 1)]


def _crash_worker(root: str, start: str) -> None:
    """Child: write turns round-robin until killed; print ACK after each durable manifest."""
    store = DiskStore(Path(root), FP, *_INFO)
    turns = json.loads(start)
    print("READY", flush=True)
    agents = sorted(turns)
    i = 0
    while True:
        agent = agents[i % len(agents)]
        turn = turns[agent] + 1
        store.write_block(_block(_crash_id(agent, turn)))
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
        self.proc = subprocess.Popen([sys.executable, "-m", _MODULE, "_crash-worker", str(root), json.dumps(acked)],
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
        store = DiskStore(root, FP, *_INFO)  # a start: stale tmp files of the dead writer go
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
            if got is None or not _same(got, _block(bid)):
                problems.append(f"{m.namespace}: block {bid[:12]} of turn {m.n_tokens - 1} unreadable or wrong")
    named = {b for m in manifests.values() for b in m.block_ids}
    orphans = set(store.iter_block_ids()) - named
    if orphans:
        problems.append(f"{len(orphans)} unreferenced block file(s) survived the start")
    if os.listdir(store.quarantine_dir):
        problems.append(f"files quarantined after a crash: {os.listdir(store.quarantine_dir)[:3]}")
    return problems


# ---------------------------------------------------------------------------------------------
# fuzzed files


def _build_fuzz_store(root: Path, agents: int = 3, blocks: int = 3) -> dict[str, list[BlockData]]:
    from ...chain import block_id, chain_seed  # here: the crash worker must start without importing MLX

    store = DiskStore(root, FP, *_INFO)
    out = {}
    for k in range(agents):
        ns, prev, chain = f"agent-{k}", None, []
        prev = chain_seed(FP, ns)
        for j in range(blocks):
            tmp = _block(hashlib.sha256(f"{ns}:{j}".encode()).hexdigest(), kib=8)
            bid = block_id(prev, tmp.tokens.tolist())
            data = BlockData(bid, tmp.tokens, tmp.arrays)
            store.write_block(data)
            chain.append(data)
            prev = bid
        store.write_manifest(Manifest(ns, [b.block_id for b in chain], 16 * blocks, 1.0))
        out[ns] = chain
    return out


def _json_edit(path: Path, fn: Callable[[Any], Any], header: bool) -> None:
    raw = path.read_bytes()
    if header:
        n = int.from_bytes(raw[:8], "little")
        body = json.dumps(fn(json.loads(raw[8:8 + n]))).encode()
        path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    else:
        path.write_text(json.dumps(fn(json.loads(raw))))


def _set_first_tensor(h: dict, key: str, value: Any) -> dict:
    name = next(k for k in sorted(h) if k != "__metadata__")
    h[name][key] = value
    return h


MUTATIONS: dict[str, Callable] = {}


def _mutation(*kinds: str):
    def deco(fn):
        for kind in kinds:
            MUTATIONS[f"{kind}:{fn.__name__.lstrip('_')}"] = fn
        return fn
    return deco


@_mutation("block", "manifest", "model")
def _bit_flip(p: Path, rng: random.Random, ctx: dict) -> None:
    raw = bytearray(p.read_bytes())
    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(raw))


@_mutation("block", "manifest", "model")
def _truncate(p: Path, rng: random.Random, ctx: dict) -> None:
    p.write_bytes(p.read_bytes()[: rng.randrange(p.stat().st_size)])


@_mutation("block", "manifest", "model")
def _zero_length(p: Path, rng: random.Random, ctx: dict) -> None:
    p.write_bytes(b"")


@_mutation("block", "manifest", "model")
def _append(p: Path, rng: random.Random, ctx: dict) -> None:
    with open(p, "ab") as f:
        f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096))))


@_mutation("block", "manifest", "model")
def _invalid_json(p: Path, rng: random.Random, ctx: dict) -> None:
    body = b"{not json" if p.suffix != ".safetensors" else (9).to_bytes(8, "little") + b"{not json"
    p.write_bytes(body)


@_mutation("block", "manifest", "model")
def _deep_json(p: Path, rng: random.Random, ctx: dict) -> None:
    deep = b"[" * 100_000
    p.write_bytes(deep if p.suffix != ".safetensors" else len(deep).to_bytes(8, "little") + deep)


@_mutation("block", "manifest", "model")
def _symlink_other(p: Path, rng: random.Random, ctx: dict) -> None:
    other = rng.choice([q for q in ctx["files"] if q != p])
    p.unlink()
    p.symlink_to(other)


@_mutation("block", "manifest", "model")
def _symlink_device(p: Path, rng: random.Random, ctx: dict) -> None:
    p.unlink()
    p.symlink_to(rng.choice(["/dev/zero", "/dev/null", "/dev/urandom"]))


@_mutation("block", "manifest", "model")
def _fifo(p: Path, rng: random.Random, ctx: dict) -> None:
    p.unlink()
    os.mkfifo(p)


@_mutation("block", "manifest", "model")
def _directory(p: Path, rng: random.Random, ctx: dict) -> None:
    p.unlink()
    p.mkdir()


@_mutation("block")
def _forged_tokens(p: Path, rng: random.Random, ctx: dict) -> None:
    store: DiskStore = ctx["store"]
    bid = p.name.split(".")[0]
    data = store.read_block(bid)
    data.tokens = data.tokens.copy()
    data.tokens[rng.randrange(len(data.tokens))] += 1 + rng.randrange(1000)
    store.write_block(data)  # a valid checksum over forged tokens


@_mutation("block")
def _swapped(p: Path, rng: random.Random, ctx: dict) -> None:
    other = rng.choice([q for q in ctx["blocks"] if q != p])
    shutil.copyfile(other, p)


@_mutation("block")
def _huge_numbers(p: Path, rng: random.Random, ctx: dict) -> None:
    v = rng.choice([2**63, 10**30, 2**64 - 1, 1e308])
    _json_edit(p, lambda h: _set_first_tensor(h, rng.choice(["shape", "data_offsets"]), [0, v]), header=True)


@_mutation("block")
def _negative_numbers(p: Path, rng: random.Random, ctx: dict) -> None:
    _json_edit(p, lambda h: _set_first_tensor(h, rng.choice(["shape", "data_offsets"]), [-1, -8]), header=True)


@_mutation("block")
def _huge_header_length(p: Path, rng: random.Random, ctx: dict) -> None:
    raw = p.read_bytes()
    p.write_bytes(rng.choice([2**63, 2**64 - 1, 17 << 20]).to_bytes(8, "little") + raw[8:])


@_mutation("block")
def _sparse_oversized(p: Path, rng: random.Random, ctx: dict) -> None:
    with open(p, "r+b") as f:
        f.truncate(rng.choice([64 << 20, 2 << 30]))


@_mutation("manifest")
def _foreign_blocks(p: Path, rng: random.Random, ctx: dict) -> None:
    store: DiskStore = ctx["store"]
    ns = next(n for n in ctx["chains"] if store.manifest_path(n) == p)
    other = rng.choice([n for n in ctx["chains"] if n != ns])
    store.write_manifest(Manifest(ns, [b.block_id for b in ctx["chains"][other]], 48, 2.0))


@_mutation("manifest")
def _renamed_to_other_agent(p: Path, rng: random.Random, ctx: dict) -> None:
    store: DiskStore = ctx["store"]
    other = rng.choice([store.manifest_path(n) for n in ctx["chains"] if store.manifest_path(n) != p])
    shutil.copyfile(other, p)


@_mutation("manifest")
def _huge_n_tokens(p: Path, rng: random.Random, ctx: dict) -> None:
    _json_edit(p, lambda b: {**b, "n_tokens": rng.choice([10**30, -5, 2**63])}, header=False)


@_mutation("model")
def _other_fingerprint(p: Path, rng: random.Random, ctx: dict) -> None:
    _json_edit(p, lambda b: {**b, "fingerprint": FP[:32] + "9" * 32}, header=False)


@_mutation("model")
def _other_format_version(p: Path, rng: random.Random, ctx: dict) -> None:
    _json_edit(p, lambda b: {**b, "format_version": rng.choice([0, 2, -1, "1", None, 10**30])}, header=False)


def _served(store: DiskStore, chains: dict[str, list[BlockData]]) -> list[str]:
    """Read every agent as the pool does (manifest, then blocks while the id chain holds); return
    problems: any block served that is not exactly that agent's own."""
    from ...chain import block_id, chain_seed

    problems, refused = [], 0
    for m in store.list_manifests():
        own = {b.block_id: b for b in chains.get(m.namespace, [])}
        prev = chain_seed(FP, m.namespace)
        for bid in m.block_ids:
            data = store.read_block(bid)
            if data is None:
                break
            if block_id(prev, data.tokens.tolist()) != bid:
                refused += 1
                break  # the pool stops (and refuses) here: nothing further is served
            if bid not in own or not _same(data, own[bid]):
                problems.append(f"{m.namespace}: served a block that is not its own ({bid[:12]})")
            prev = bid
    return problems + [f"chain-refused {refused}"] * bool(refused)


def fuzz_campaign(trials: int, seed: int, work: Path, timeout: float = 30) -> dict:
    rng = random.Random(seed)
    names = sorted(MUTATIONS)
    outcomes: dict[str, dict[str, int]] = {}
    failures: list[dict] = []
    for trial in range(trials):
        name = names[trial % len(names)] if trial < len(names) else rng.choice(names)
        kind = name.split(":")[0]
        root = work / "fuzz" / f"t{trial}"
        chains = _build_fuzz_store(root)
        store = DiskStore(root, FP, *_INFO)
        blocks = sorted(store.blocks_dir.glob("*/*.safetensors"))
        manifests = sorted(store.agents_dir.glob("*.json"))
        target = {"block": lambda: rng.choice(blocks), "manifest": lambda: rng.choice(manifests),
                  "model": lambda: store.dir / "model.json"}[kind]()
        ctx = {"store": store, "chains": chains, "blocks": blocks, "files": blocks + manifests}
        MUTATIONS[name](target, rng, ctx)
        result: dict[str, Any] = {}

        def reopen() -> None:
            try:
                s = DiskStore(root, FP, *_INFO)
            except StoreError as e:
                result["refused"] = str(e)
                return
            result["problems"] = _served(s, chains)
            result["quarantined"] = len(os.listdir(s.quarantine_dir))

        t = threading.Thread(target=reopen, daemon=True)
        t.start()
        t.join(timeout)
        repro = {"trial": trial, "seed": seed, "mutation": name, "target": str(target.relative_to(root))}
        if t.is_alive():
            failures.append({**repro, "problem": f"hang over {timeout}s"})
            outcome = "hang"
        elif "refused" in result:
            outcome = "refused"
            if kind != "model" or "\n" in result["refused"]:
                failures.append({**repro, "problem": f"refused at open: {result['refused'][:200]}"})
        elif "problems" not in result:
            outcome = "crash"
            failures.append({**repro, "problem": "exception on reopen (see log)"})
        else:
            chain = [p for p in result["problems"] if p.startswith("chain-refused")]
            result["problems"] = [p for p in result["problems"] if p not in chain]
            outcome = "quarantined" if result["quarantined"] else "chain-refused" if chain else "ignored"
            if result["problems"]:
                outcome = "served-bad"
                failures.append({**repro, "problem": result["problems"][0]})
        outcomes.setdefault(name, {}).setdefault(outcome, 0)
        outcomes[name][outcome] += 1
        if not t.is_alive():
            shutil.rmtree(root, ignore_errors=True)
    return {"trials": trials, "failures": len(failures), "failure_cases": failures[:20], "outcomes": outcomes}


# ---------------------------------------------------------------------------------------------
# report


def _server(name: str) -> Callable:
    """A campaign against a real server (server_campaigns.py), imported only when run."""
    def run(trials: int, seed: int, work: Path, **kw: Any) -> dict:
        from . import server_campaigns

        return getattr(server_campaigns, f"{name}_campaign")(trials, seed, work, **kw)
    return run


def _state_machine(trials: int, seed: int, work: Path) -> dict:
    """Every pool operation at random against a reference model (pool_machine.py), imported only when run."""
    from .pool_machine import campaign

    return campaign(trials, seed, work)


def _fleet_machine(trials: int, seed: int, work: Path) -> dict:
    """The state machine with the fleet rules on every seed (partitions through tools/reliability/partition.py)."""
    from .pool_machine import campaign

    return campaign(trials, seed, work, fleet_only=True)


# name: (function, full trials, quick trials); soak and storm count seconds, interactions steps,
# state_machine and fleet examples
CAMPAIGNS = {"crash": (crash_campaign, 1000, 60), "fuzz": (fuzz_campaign, 1000, 60),
             "state_machine": (_state_machine, 400, 20), "fleet": (_fleet_machine, 200, 10),
             "server_crash": (_server("server_crash"), 100, 4), "disk": (_server("disk"), 4, 1),
             "storm": (_server("storm"), 300, 15), "soak": (_server("soak"), 3600, 40),
             "interactions": (_server("interactions"), 700, 100)}
# Campaigns that report their figures so far while they run (`progress`), and return them when stopped.
PROGRESS = {"interactions"}


def _machine() -> str:
    from ..serving import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _report_server_crash(r: dict) -> list[str]:
    if "modes" not in r:
        return []
    return [f"Server lifetimes, each ended by one SIGKILL: {', '.join(f'{k} {v}' for k, v in sorted(r['modes'].items()))} "
            f"(write-point: the server killed itself before a chosen write step, {r['write_point_kills']} times; "
            f"final-check: one more start, no kill). Completed turns: {r['completed_turns']}, of which "
            f"{r['turns_checked_across_a_kill']} were checked after a kill (the agent's next turn's cached_tokens "
            f"cover the turn before); replies compared with a never-killed server: {r['replies_compared']}; "
            f"requests in flight at a kill (retried after the restart): {r['requests_killed_in_flight']}."]


def _report_disk(r: dict) -> list[str]:
    if "phases" not in r:
        return []
    keys = ("requests_ok", "hits_hot", "hits_disk", "misses", "write_errors", "save_failures", "retries",
            "saves_dropped", "unsaved_blocks_dropped", "read_errors", "quarantined")
    out = [f"Fault: {r['tmpfs']}; then EIO injected on fsync, then on reads (faults.py). Server restarts: "
           f"{r['restarts']}. RSS: {r['rss_baseline_mb']} MB after warm-up, peak {r['rss_peak_mb']} MB, bound "
           f"{r['rss_bound_mb']} MB (warm-up + hot_mb + stated overhead). Pool hot_bytes peak {r['hot_bytes_peak']} "
           f"against hot_mb {r['hot_budget_bytes']}, bound {r.get('hot_bound_bytes')} (hot_mb + the turn being "
           f"committed, all of it unsaved on a failing disk).", "",
           "| phase | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for phase, p in r["phases"].items():
        out.append(f"| {phase} | " + " | ".join(str(p.get(k, "")) for k in keys) + " |")
    return out


def _report_soak(r: dict) -> list[str]:
    if "tiers" not in r:
        return []
    out = [f"{r['agents']} agents over {r['clients']} clients for {r['seconds_run']} s (hot_mb {r['hot_mb']}, "
           f"disk_mb {r['disk_mb']}); requests per tier: {r['tiers']}; budget erasures {r['budget_erasures']}, "
           f"agents evicted from memory {r['evicted_agents']}. RSS after warm-up {r['rss_after_warmup_mb']} MB, "
           f"peak after {r['rss_peak_after_warmup_mb']} MB, bound {r['rss_bound_mb']} MB; growth of the resident "
           f"minimum, last third against first, {(r.get('rss_growth_mb') or {}).get('low')} MB (limit "
           f"{r.get('rss_growth_limit_mb')} MB, judged on runs of {r.get('rss_growth_min_s')} s or more); disk peak "
           f"{r['disk_peak_bytes']} bytes (budget {int(r['disk_mb'] * 2**20)} + one turn).", "",
           "| window (s) | hot p50/p90/p99 ms (n) | disk p50/p90/p99 ms (n) | miss p50/p90/p99 ms (n) |",
           "|---|---|---|---|"]
    cell = lambda d: f"{d['p50_ms']}/{d['p90_ms']}/{d['p99_ms']} ({d['n']})" if d else "-"  # noqa: E731
    for w in r["latency"]:
        out.append(f"| {w['from_s']}-{w['to_s']} | {cell(w['hot'])} | {cell(w['disk'])} | {cell(w['miss'])} |")
    return out


def _report_storm(r: dict) -> list[str]:
    if "requests" not in r:
        return []
    return [f"{r['clients']} concurrent clients for {r['seconds_run']} s; slowest request {r['slowest_request_s']} s; "
            f"agents' next turns checked against a cold server afterwards: {r['agents_verified_after']}.", "",
            "| request kind | outcomes |", "|---|---|"] + [
        f"| {k} | {', '.join(f'{o} {n}' for o, n in sorted(v.items()))} |" for k, v in sorted(r["requests"].items())]


def _report_interactions(r: dict) -> list[str]:
    if "ops" not in r:
        return []
    ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
    ends = ", ".join(f"{k} {v}" for k, v in sorted(r["lifetimes"].items()))
    longest = f", histories of up to {r['longest_history_turns']} turns" if "longest_history_turns" in r else ""
    stopped = [f"Stopped after {r['trials']} steps (by a signal, or still running when written): the figures "
               "are those of the steps done, without the final restart and check.", ""]
    out = (stopped if r.get("stopped_before_final_check") else []) + [
        f"{r['trials']} steps (seed {r.get('seed', '?')}), {r['agents']} agent ids{longest} (hot_mb {r['hot_mb']}, disk_mb {r['disk_mb']}, ttl_hours "
           f"{r['ttl_hours']}, blocks of {r['block_size']} tokens, durable writes). Steps: {ops}. Server lifetimes, by "
           f"how they ended: {ends} (write-point: the server killed itself before a chosen write step, "
           f"{r['write_point_kills']} times; requests in flight at a kill: {r['requests_killed_in_flight']}).", "",
           f"Answers: {r['answers']}, every one compared with the never-killed reference: {r['replies_compared']}"
           + (f" ({r['cold_replies_equal_to_cold_reference']} computed without a cache differed from the reference's "
              "over its cached prefix and equalled its reply without one)" if r.get(
               "cold_replies_equal_to_cold_reference") else "") + ". "
           f"Acknowledged turns checked for reuse: {r['turns_checked']} ({r['turns_checked_across_a_restart']} as an "
           f"agent's first turn after a restart; {r['losses_excused_by_erasure']} not reused because a logged erasure "
           f"removed the agent); forks' first requests checked against the parent's turn: {r['fork_first_checked']}. "
           f"Erasures requested: {r['erasures_requested']}, erased ids used again: {r['erased_revisited']}; "
           f"erasures by "
           f"the disk budget: {r['budget_erasures_logged']}, by the TTL: {r['ttl_erasures_logged']}; pins "
           f"{r['pins']}, unpins {r['unpins']}; isolation probes (another agent's history under a new id): "
           f"{r['probes']}.", "",
           f"/health: {r['health_polls']} polls, slowest {r['health_worst_s']} s, {r['health_late']} past 1 s or "
           f"failed. Pool hot_bytes peak {r['hot_bytes_peak']} (bound there {r['hot_bound_at_peak']}: hot_mb + the "
           f"largest agent's last 4 sequences + pinned agents), {r['hot_over']} samples over. Disk peak "
           f"{r['disk_peak_bytes']} bytes (bound there {r['disk_bound_at_peak']}: disk_mb + one turn per request in "
           f"flight + pinned agents), {r['disk_over']} samples over. RSS after warm-up {r['rss_after_warmup_mb']} MB, peak "
           f"{r['rss_peak_mb']} MB, bound {r['rss_bound_mb']} MB.", ""]
    if r.get("failure_kinds"):
        out += ["| failure kind | count | first step |", "|---|---|---|"]
        out += [f"| {k} | {v['count']} | {v['first_step']} |" for k, v in sorted(r["failure_kinds"].items())]
        out += ["", "The first failure of each kind, with the steps before it (`--campaigns interactions --seed S "
                "--trials N` replays the same choices; timings may differ):", ""]
        shown: set[str] = set()
        for f in r["failure_cases"]:
            if f["kind"] in shown:
                continue
            shown.add(f["kind"])
            out.append(f"- {f['kind']} at step {f['step']} ({f['op']}, seed {f['seed']}): {f['problem'][:300]}; "
                       f"steps before: {'; '.join(f['steps'])}")
        out.append("")
    return out


_WHAT = {
    "crash": "A subprocess writes agents' blocks and manifests through the real store and is SIGKILLed, half the "
             "trials before a chosen system call of a write (open, write, fsync, rename, directory fsync; the "
             "store's fault hook), half at a random moment. Then the store is reopened as a server start does: "
             "every turn acknowledged as durable must read back exactly, nothing half-written may be served, no "
             "temp file or unreferenced block may survive the start.",
    "fuzz": "One mutation per trial of a block file, manifest or model.json (bit flips, truncation, zero length, "
            "appended bytes, forged tokens with a recomputed checksum, swapped blocks, foreign manifests, symlinks "
            "to files and devices, FIFOs, directories, huge or negative numbers, invalid or deeply nested JSON); "
            "the store is reopened and read as the pool reads it. Failure: a crash, a hang, or any damaged or "
            "foreign KV served. Outcomes: quarantined, chain-refused (sound file whose tokens do not chain), "
            "ignored, refused (model directory: the server then serves from memory and says so).",
    "server_crash": "A real `vllm-mlx serve --cache-backend persist_q4` (tiny local model) with 4 agents in flight "
                    "is SIGKILLed once per lifetime: mid-request, right after a response, or by itself before a "
                    "chosen write step. Failures: a completed turn not covered by the agent's next turn's "
                    "cached_tokens, a request failing while the server is up, a reply different from a "
                    "never-killed reference server's reply to the same conversation.",
    "disk": "The cache root on an 8 MB tmpfs (disk_mb 6), filled with a file, then emptied; then EIO injected on fsync, then on "
            "reads. Failures: a failed request, a reply different from the reference, memory over its bound, no "
            "counter saying what was not cached, a cache that does not work again (across a SIGKILL) once the "
            "fault is gone, a sound file quarantined on EIO.",
    "storm": "Concurrent clients mixing agents' turns (the same agent from several clients at once), streams "
             "aborted with a TCP reset, requests hung up early, invalid bodies and agent ids. Failures: the "
             "server down, a request past its time-out (120 s), a 5xx for a bad body, a bad id not answered 400, "
             "and any agent whose next turn afterwards differs from a fresh server given the same history cold.",
    "fleet": "The state machine (below) with the fleet rules on every seed: two pools sharing a redis-server, "
             "each through its own partition proxy (tools/reliability/partition.py), the second one cut off and healed at "
             "random while both serve, erase and forget; the first one's erasures and forgets killed (-9) "
             "at each step before their publish; forget edits past the removal records' bound. Failures: "
             "those of the state machine, and an acknowledged erasure that never reaches Redis or comes back "
             "after the restart, a removal one pool holds after its first sync since the other published "
             "it (docs/fleet.md, The merge rules).",
    "state_machine": "A Hypothesis state machine (vllm_mlx_persist/tools/reliability/pool_machine.py) drives the real pool, "
                     "persister and store, and with a redis-server a second pool sharing the fleet tier, through "
                     "random sequences of turns, forks, concurrent branches of one agent, re-tokenized turns "
                     "(matching by text), forget and amortize edits (spliced branches), histories sent again after "
                     "an erasure or a forget, anonymous requests, erasures, pins, hot and disk budget changes, the "
                     "TTL (a clock moved on), restarts, crashes (writes failing with turns queued), kills just "
                     "before the Nth write step, and turns whose saves stay queued behind a held writer while an "
                     "erasure, a disk budget or a sweep runs, against a reference model of what every agent should "
                     "hold. Failures: a served prefix not from the agent's (or its explicit fork parent's) histories, "
                     "from one an erasure removed or a forget superseded, or with other K/V bytes (a splice's served "
                     "to an exact lookup), text read that the client did not send, an operation past 60 s, a broken "
                     "block-table invariant, a branch held that is none of the agent's allowed histories, an agent "
                     "evicted from memory while an unpinned one used less recently stays (the LRU order), a pinned "
                     "agent leaving memory, hot or disk bytes past their budget plus one turn and the pinned agents, "
                     "a block file no manifest names or a named block without its file, a manifest on disk of an "
                     "agent the pool does not hold, after a kill a manifest naming a block missing or unsound, an "
                     "acknowledged turn not reused after a restart, crash or kill unless an erasure the stats record "
                     "removed the agent, a pinned agent erased by the budget or the TTL, a request in flight during "
                     "its agent's erasure storing its turn, a save lost on a sound disk. Trials are examples (sequences of steps). The defects "
                     "injected by hand that this model catches are in the last section.",
    "soak": "16 agents round-robin from 4 clients with growing histories (new session past 12 turns), hot_mb "
            "and disk_mb small enough that all three tiers occur. Failures: a failed request, RSS past the "
            "post-warm-up RSS + hot_mb + 1 GB (transient buffers of concurrent prefills), growth of the resident "
            "minimum (lowest RSS of the last third against the first) past 64 MB + hot_mb on runs of 10 minutes "
            "or more, disk past disk_mb + one turn. The full run is one hour "
            "(`./dev reliability --campaigns soak`: about 62 minutes on 2 cores, a few hundred MB of memory "
            "and under 10 MB of disk; it replaces only this row).",
    "interactions": "One server under tight budgets (hot_mb 0.25: two or three agents' histories; disk_mb 4: a "
                    "dozen or so; ttl_hours 0.01) runs a random mix of steps: turns of growing histories, several agents at once, forks "
                    "(fork_from), concurrent branches of one agent, DELETE /v1/agents/ID, reuse of an erased id, pins "
                    "and unpins, another agent's history under a new id (isolation probe), anonymous requests, "
                    "SIGKILLs between steps, mid-request and at a chosen write step; one more restart at the end, "
                    "then every conversation's next turn. Failures: a reply different from a never-killed "
                    "reference server's (same conversation; an answer computed without a cache, where it differs "
                    "from the reference's over a cached prefix, must equal the reference's without one: the two "
                    "paths agree to float rounding), an acknowledged turn (or a fork parent's) not covered "
                    "by the next request's cached_tokens unless the server's log records an erasure of that agent, "
                    "an erased agent listed or served again, cached tokens for a new id, a pinned agent erased, an "
                    "agent gone after a restart with no erasure logged, a request failing or past 15 s while the "
                    "server is up, /health slower than 1 s, hot_bytes, disk or RSS past their bounds. Full run: "
                    "`./dev reliability --campaigns interactions` (700 steps, about 4 minutes on 2 cores); "
                    "`--quick`: 100 steps, under a minute; `--trials interactions=10000`: about an hour (a history, "
                    "a fork's inherited turns included, stops at 7 turns before the final check's, so the rate stays "
                    "~170-190 steps a minute). "
                    "A run of any length makes every kind of step: its last steps make those not drawn yet (erase, "
                    "then revisit). A long run's figures so far are written every 250 steps.",
}


def _report_state_machine(r: dict) -> list[str]:
    if "seeds" not in r:
        return []
    return [f"Steps: {r['steps']} on one pool, {r['fleet_steps']} with the fleet rules (a second pool sharing a "
            f"redis-server), over {len(r['seeds'])} seeds of up to {r['steps_per_example']} steps per example "
            f"(seeds {r['seeds'][0]['seed']}-{r['seeds'][-1]['seed']}; the second of every four with the fleet).", "",
            "Shrunk failures found while the campaign was built, each fixed and kept as a test: a shorter turn after a "
            "restart lost to the fleet sync (tests/test_state_machine.py), the fork + hot budget + restart hang and "
            "the others of tests/test_compose.py. Found by earlier full runs of this campaign (2026-11-25), fixed, "
            "kept as tests: an unpin that left the hot tier over hot_mb until the next request (seed 30, "
            "tests/test_compose.py), and a fork served the first token of a parent history erased through the other "
            "server, because only the child was synced before the lookup (seed 17, tests/test_state_machine.py). "
            "Found by the extended model (issue #30), fixed, kept as tests: an erasure that left the blocks only "
            "a dropped retry wrote, and a retry superseded or given up that left the blocks only it kept (tests/test_store.py), an anonymous "
            "entry shadowed by a new one of the same name (tests/test_pool.py), and an erasure that dropped "
            "the saves of its agent queued after it (tests/test_state_machine.py, tests/test_store.py)."]


_SERVER_REPORT = {"server_crash": _report_server_crash, "disk": _report_disk, "soak": _report_soak,
                  "storm": _report_storm, "interactions": _report_interactions, "state_machine": _report_state_machine,
                  "fleet": _report_state_machine}


def _notes(md: Path) -> list[str]:
    """Paragraphs written by hand between a report's Date line and its table's preamble."""
    try:
        text = md.read_text()
    except OSError:
        return []
    head, sep, _ = text.partition("Each campaign's own command")
    if not sep or "\nDate: " not in head:
        return []
    body = head.split("\nDate: ", 1)[1].split("\n", 1)[1] if "\n" in head.split("\nDate: ", 1)[1] else ""
    return [p.strip() for p in body.split("\n\n") if p.strip()]


def _merged(results: dict, path: Path) -> dict:
    """`results` over the report already at `path`: campaigns not run this time keep their figures (each
    campaign carries the command, date and machine of its own run), so the soak can be run on its own.
    While the old report keeps campaigns this run did not replace, its header (command, machine, date
    and the notes under it) stays: it describes those campaigns' run."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return results
    if not isinstance(old.get("campaigns"), dict):
        return results
    campaigns = {}
    for n, c in old["campaigns"].items():
        if n in CAMPAIGNS and "run" in c:
            c["run"].setdefault("machine", old.get("machine"))
            campaigns[n] = c
    kept = set(campaigns) - set(results["campaigns"])
    campaigns.update(results["campaigns"])
    head = {}
    if kept:
        head = {k: old[k] for k in ("machine", "date", "command") if k in old}
        head["notes"] = old.get("notes") or _notes(path.with_suffix(".md"))
    return {**results, **head, "campaigns": {n: campaigns[n] for n in CAMPAIGNS if n in campaigns}}


# A section written by hand at the end of reliability.md (the state machine's injected defects,
# from tools/reliability/mutants.py): a rewrite of the report keeps it.
KEPT_SECTION = "## The state machine against injected defects"


def write_report(results: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    lines = ["# Reliability campaigns", "", f"Command: `{results.get('command', command)}`  ",
             f"Machine: {results['machine']}  ", f"Date: {results['date']}", ""]
    for note in results.get("notes") or []:
        lines += [note, ""]
    lines += ["Each campaign's own command and date are in its row (a campaign run on its own replaces only its row).",
              "", "| campaign | trials | failures | seconds | run |", "|---|---|---|---|---|"]
    for name, r in results["campaigns"].items():
        run = r.get("run", {})
        how = f"{run.get('date', '')}, `{run.get('command', command)}`" + (" (quick)" if run.get("quick") else "")
        if run.get("machine", results["machine"]) != results["machine"]:
            how += f", on {run['machine']}"
        stopped = " (stopped)" if r.get("stopped_before_final_check") else ""
        lines.append(f"| {name} | {r['trials']}{stopped} | {r['failures']} | {r['seconds']} | {how} |")
    for name, r in results["campaigns"].items():
        lines += ["", f"## {name}", "", _WHAT.get(name, ""), ""]
        if name == "crash":
            lines.append(f"Acknowledged turns: {r['acked_turns']}; temp files removed at restart: "
                         f"{r['tmp_removed']}; unreferenced blocks removed at restart: {r['orphans_removed']}; "
                         f"kills during start-up: {r['killed_before_ready']}; kills at a chosen write step "
                         f"(before the Nth open, write, fsync, rename or dir fsync, N = 1..{DET_STEPS // 5} per kind): "
                         f"{r['deterministic_trials']} ("
                         + ", ".join(f"{k} {v}" for k, v in sorted(r["points"].items())) + ").")
        if name == "fuzz":
            lines += ["| mutation | outcomes |", "|---|---|"]
            for mut, o in sorted(r["outcomes"].items()):
                lines.append(f"| {mut} | {', '.join(f'{k} {v}' for k, v in sorted(o.items()))} |")
        if name in _SERVER_REPORT:
            lines += _SERVER_REPORT[name](r)
        for f in r["failure_cases"]:
            lines.append(f"- FAILURE (reproduce with `--campaigns {name} --seed {f['seed']}`): `{json.dumps(f)[:400]}`")
    md = out / "reliability.md"
    kept = md.read_text().partition(KEPT_SECTION)[1:] if md.exists() else ("", "")
    md.write_text("\n".join(lines) + "\n" + ("\n" + "".join(kept) if kept[0] else ""))


def _trials_arg(text: str) -> dict[str, int]:
    """`--trials`: "N" (every campaign) or "name=N,name=N" -> {name or "*": N}."""
    try:
        if "=" not in text:
            return {"*": int(text)}
        pairs = (part.split("=", 1) for part in text.split(",") if part.strip())
        return {name.strip(): int(n) for name, n in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or NAME=N,...: {text!r}") from None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_crash-worker":
        _crash_worker(argv[1], argv[2])
        return 0
    p = argparse.ArgumentParser(prog="vllm-mlx-persist reliability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about a minute: fewer trials per campaign")
    p.add_argument("--campaigns", default=",".join(CAMPAIGNS), help=f"comma-separated, of {sorted(CAMPAIGNS)}")
    p.add_argument("--trials", type=_trials_arg, default={},
                   help="trials per campaign, overriding --quick: N for every campaign, or NAME=N,... for some")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--out", default="docs", help="directory for reliability.md and reliability.json")
    p.add_argument("--work", help="scratch directory (default: a temporary one)")
    p.add_argument("--progress-steps", type=int, default=250, metavar="N",
                   help="interactions: write the report with the figures so far every N steps (default 250)")
    args = p.parse_args(argv)
    # Quarantines are expected by the thousand here; the campaigns count them.
    logging.getLogger("vllm_mlx_persist.store").setLevel(logging.ERROR)
    names = [n.strip() for n in args.campaigns.split(",") if n.strip()]
    unknown = (set(names) | set(args.trials) - {"*"}) - set(CAMPAIGNS)
    if unknown:
        p.error(f"unknown campaign(s) {sorted(unknown)}; known: {sorted(CAMPAIGNS)}")
    results: dict[str, Any] = {"machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": "vllm-mlx-persist reliability " + " ".join(argv), "campaigns": {}}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vllm-mlx-persist-reliability-"))
    # SIGTERM as Ctrl-C: the campaign in progress stops its servers (no orphans) and keeps its figures.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def record(name: str, r: dict, t0: float, quick: bool) -> None:
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["run"] = {"command": results["command"], "date": results["date"], "quick": quick,
                    "machine": results["machine"]}
        results["campaigns"][name] = r
        # after every campaign (and a long one's progress), so a run stopped later keeps its figures
        write_report(_merged(results, Path(args.out) / "reliability.json"), Path(args.out), results["command"])

    try:
        for name in names:
            fn, full, quick = CAMPAIGNS[name]
            trials = args.trials.get(name) or args.trials.get("*") or (quick if args.quick else full)
            is_quick = bool(args.quick and trials == quick)
            t0 = time.perf_counter()
            kw = {"progress": lambda r, name=name, t0=t0: record(name, r, t0, is_quick),
                  "every": args.progress_steps} if name in PROGRESS else {}
            try:
                r = fn(trials, args.seed, work, **kw)
            except Exception:  # a campaign that cannot finish is a failure, with its reason
                import traceback

                done = results["campaigns"].get(name, {}).get("trials", 0) if name in PROGRESS else trials
                r = {"trials": done, "failures": 1, "failure_cases": [  # trials: those reported done, if any
                    {"seed": args.seed, "problem": f"campaign raised: {traceback.format_exc()[-1500:]}"}]}
            record(name, r, t0, is_quick)
            print(f"{name}: {r['trials']} trials, {r['failures']} failures, {r['seconds']} s"
                  + (" (stopped before the end)" if r.get("stopped_before_final_check") else ""), flush=True)
            for case in r.get("failure_cases", []):
                print(f"  {name} failure: {json.dumps(case)[:600]}", flush=True)
            if r.get("stopped_before_final_check"):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("stopped: the report keeps the figures of what ran", flush=True)
        return 130
    finally:
        if any(n in names for n in ("server_crash", "disk", "storm", "soak", "interactions")):
            from .server_campaigns import close_shared

            close_shared()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["failures"] for r in results["campaigns"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
