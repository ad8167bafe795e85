"""Latency of a fork admission (pool.BlockPool.may_fork: what the namespace hook waits for on the HTTP
event loop) with the fleet tier on a local redis-server: a parent with an 8-block history in Redis, and
an unknown one, 300 calls each. Run from the repository root:
    PYTHONPATH=$PWD python tests/fork_answer_latency.py
(docs/fleet.md, "The fork answer")."""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_remote import SECRET, RedisServer, chain, fleet_pool, manifest  # noqa: E402

from vllm_mlx_persist.fleet import FleetSettings, RemoteTier  # noqa: E402


def main(calls: int = 300) -> None:
    tmp = Path(tempfile.mkdtemp())
    fp = "f" * 64
    (tmp / "redis").mkdir()
    rds = RedisServer(tmp / "redis")
    try:
        w = RemoteTier(FleetSettings(rds.url, secret=SECRET), fp)
        hist = chain(fp, "p", 8)
        assert w.put(manifest("p", hist), {b.block_id: b for b in hist}) and w.flush(10)
        pool = fleet_pool(fp, tmp / "b", lambda **cb: RemoteTier(FleetSettings(rds.url, secret=SECRET), fp, **cb))
        for name in ("p", "unknown"):
            pool.may_fork(name)  # the connection made
            ms = []
            for _ in range(calls):
                t0 = time.perf_counter()
                pool.may_fork(name)
                ms.append((time.perf_counter() - t0) * 1e3)
            ms.sort()
            print(f"{name}: median {statistics.median(ms):.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms, "
                  f"max {ms[-1]:.3f} ms")
        print("settings_reads:", pool.fleet.stats()["settings_reads"])
        pool.close()
        w.close(2)
    finally:
        rds.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
