"""`vllm-mlx-persist agents list|show|rm|gc --cache-dir DIR`: the agents of a cache root, offline.

For a root no server is using: it takes the root's lock, so while a server holds it the command
refuses, names the server's pid and points to the HTTP API (`/v1/agents`) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from .cache_root import CacheDirLock, erase_agent_files, model_dirs
from .chain import branches_of
from .disk_format import Manifest
from .namespace import legacy_spliced
from .store import DiskStore, StoreError


def _model_stores(root: Path) -> Iterator[DiskStore]:
    """Every model directory under the root that can be opened (others are reported and skipped)."""
    for path in model_dirs(root):
        try:
            yield DiskStore.open_existing(path)
        except StoreError as e:
            print(f"skipped: {e}", file=sys.stderr)


def _describe(store: DiskStore, m: Manifest, legacy: list[Manifest]) -> dict:
    """One agent's row: its record's manifest `m` and the spliced histories an earlier layout kept in
    manifests of their own (`legacy`; a server moves them into the record when it next loads)."""
    branches = [br for x in [m, *legacy] for br in branches_of(x)]
    honest = [br for br in branches_of(m) if not br.spliced]
    blocks = {b for x in [m, *legacy] for b in x.block_ids}
    return {
        "id": m.namespace,
        "model_dir": store.dir.name,
        "tokens": honest[-1].n_tokens if honest else 0,
        "branches": len(honest),
        "spliced_branches": len(branches) - len(honest),
        "blocks": len(blocks),
        "bytes_disk": sum(store.block_file_size(b) for b in blocks),
        "pinned": m.pinned,
        "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(x.updated_at for x in [m, *legacy]))),
    }


def _records(store: DiskStore) -> list[tuple[Manifest, list[Manifest]]]:
    """The agents of a model directory: each record's manifest with its spliced histories of the
    earlier layout (an agent known only through those gets an empty record)."""
    own: dict[str, Manifest] = {}
    old: dict[str, list[Manifest]] = {}
    for m in store.list_manifests():
        spliced = legacy_spliced(m.namespace)
        if spliced is None:
            own[m.namespace] = m
        else:
            old.setdefault(spliced[0], []).append(m)
    for name in old.keys() - own.keys():
        own[name] = Manifest(name, [], 0, max(m.updated_at for m in old[name]), branches=[])
    return [(own[name], old.get(name, [])) for name in sorted(own)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mlx-persist agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["list", "show", "rm", "gc"])
    parser.add_argument("agent_id", nargs="?")
    parser.add_argument("--cache-dir", required=True, help="the cache root (persist_q4's cache_dir)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.action in ("show", "rm") and not args.agent_id:
        parser.error(f"{args.action} needs an agent id")
    root = Path(os.path.expanduser(args.cache_dir))
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 2
    try:
        lock = CacheDirLock(root)
    except (StoreError, OSError) as e:
        print(f"error: {e}. While a server runs, use its HTTP API: GET /v1/agents, GET or DELETE "
              f"/v1/agents/ID.", file=sys.stderr)
        return 2
    try:
        return _run(args, root)
    finally:
        lock.release()


def _run(args: argparse.Namespace, root: Path) -> int:
    stores = list(_model_stores(root))
    if args.action == "gc":
        removed = sum(s.gc(set()) for s in stores)  # blocks no manifest names, stale temp files
        print(f"removed {removed} unreferenced block file(s) in {len(stores)} model director(ies)")
        return 0
    if args.action == "rm":  # under every model directory, those of other disk formats too
        erased = [d.name for d in model_dirs(root) if erase_agent_files(d, args.agent_id) >= 0]
        if not erased:
            print(f"no agent {args.agent_id!r} under {root}", file=sys.stderr)
            return 1
        print(f"erased {args.agent_id!r} from {len(erased)} model director(ies)")
        return 0
    rows = [_describe(s, m, old) for s in stores for m, old in _records(s)
            if args.action == "list" or m.namespace == args.agent_id]
    if args.action == "show" and not rows:
        print(f"no agent {args.agent_id!r} under {root}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        cols = ["id", "model_dir", "tokens", "branches", "spliced_branches", "blocks", "bytes_disk", "pinned",
                "last_used"]
        print("\t".join(cols))
        for r in rows:
            print("\t".join(str(r[c]) for c in cols))
    return 0
