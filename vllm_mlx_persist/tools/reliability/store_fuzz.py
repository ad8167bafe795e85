"""`vllm-mlx-persist reliability --campaigns fuzz`: a store of agents built with the pool's chained
block ids gets one mutation per trial (bit flips, truncation, forged tokens with a recomputed checksum,
swapped blocks, foreign manifests, links, FIFOs, directories, huge or negative numbers, invalid or deeply
nested JSON) and is reopened and read as the pool reads it; each outcome is classified quarantined /
ignored / refused, and any crash, hang or damaged or foreign KV served is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from ...chain import block_id, chain_seed
from ...disk_format import BlockData, Manifest
from ...store import DiskStore, StoreError
from .store_blocks import FP, INFO, block_for, same_block


def _build_fuzz_store(root: Path, agents: int = 3, blocks: int = 3) -> dict[str, list[BlockData]]:
    store = DiskStore(root, FP, *INFO)
    out = {}
    for k in range(agents):
        ns, prev, chain = f"agent-{k}", None, []
        prev = chain_seed(FP, ns)
        for j in range(blocks):
            tmp = block_for(hashlib.sha256(f"{ns}:{j}".encode()).hexdigest(), kib=8)
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
            if bid not in own or not same_block(data, own[bid]):
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
        store = DiskStore(root, FP, *INFO)
        blocks = sorted(store.blocks_dir.glob("*/*.safetensors"))
        manifests = sorted(store.agents_dir.glob("*.json"))
        target = {"block": lambda: rng.choice(blocks), "manifest": lambda: rng.choice(manifests),
                  "model": lambda: store.dir / "model.json"}[kind]()
        ctx = {"store": store, "chains": chains, "blocks": blocks, "files": blocks + manifests}
        MUTATIONS[name](target, rng, ctx)
        result: dict[str, Any] = {}

        def reopen() -> None:
            try:
                s = DiskStore(root, FP, *INFO)
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
