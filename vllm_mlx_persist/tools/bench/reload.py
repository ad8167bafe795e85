"""`vllm-mlx-persist bench --sections reload`: in-process, the time to load an agent's cache from disk
(page cache dropped) against its size and against the sequential read bandwidth of the same disk;
the block checksums' speed on this CPU."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from .kit import MB, Ctx, drop_page_cache, median, say


def _read_file(path: Path, direct: bool, chunk: int = 8 * MB) -> float:
    """Seconds to read the whole file sequentially (O_DIRECT into an aligned buffer if `direct`)."""
    import mmap

    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        t = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        return time.perf_counter() - t
    finally:
        buf.close()
        os.close(fd)


def measure_bandwidth(path: Path, size_mb: int, reps: int) -> dict:
    """Sequential read bandwidth of the disk under `path`: buffered reads after dropping the file from
    the page cache (posix_fadvise DONTNEED), O_DIRECT reads, and reads from the page cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MB)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, size_mb // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    size = path.stat().st_size
    res: dict = {"file_mb": round(size / MB), "write_fsync_mb_s": round(size / MB / write_s, 1)}
    cold, direct, warm, resident = [], [], [], []
    for _ in range(reps):
        d = drop_page_cache([path])
        resident.append(d["resident_after"])
        cold.append(size / MB / _read_file(path, direct=False))
        warm.append(size / MB / _read_file(path, direct=False))
        try:
            drop_page_cache([path])
            direct.append(size / MB / _read_file(path, direct=True))
        except OSError as e:
            res["direct_error"] = str(e)
    res.update({
        "buffered_after_drop_mb_s": round(median(cold), 1), "buffered_after_drop_samples": [round(x, 1) for x in cold],
        "o_direct_mb_s": round(median(direct), 1) if direct else None, "o_direct_samples": [round(x, 1) for x in direct],
        "page_cache_mb_s": round(median(warm), 1), "resident_after_drop": resident,
    })
    path.unlink()
    return res


def measure_checksums(size_mb: int = 64, threads: int = 2) -> dict:
    """MB/s of the block integrity check (sha256) on this CPU, on one thread and on `threads` (the
    pool's readers; hashlib releases the GIL), beside cheaper checks it could have been."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    chunk = os.urandom(MB)
    bufs = [chunk * (size_mb // threads) for _ in range(threads)]
    total = sum(len(b) for b in bufs) / MB

    def rate(fn: Callable[[bytes], Any], parallel: bool) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            if parallel:
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(fn, bufs))
            else:
                for b in bufs:
                    fn(b)
            best = min(best, time.perf_counter() - t)
        return round(total / best, 1)

    return {"threads": threads, "sha256_mb_s": rate(lambda b: hashlib.sha256(b).digest(), False),
            "sha256_parallel_mb_s": rate(lambda b: hashlib.sha256(b).digest(), True),
            "blake2b_mb_s": rate(lambda b: hashlib.blake2b(b).digest(), False),
            "crc32_mb_s": rate(zlib.crc32, False)}


def _random_q4_cache(n_layers: int, n_kv: int, head_dim: int, n: int, seed: int) -> list:
    import mlx.core as mx

    from ...caches.q4 import Q4KVCache

    mx.random.seed(seed)
    caches = []
    for _ in range(n_layers):
        c = Q4KVCache(group_size=64, bits=4)
        k = mx.random.normal((1, n_kv, n, head_dim))
        v = mx.random.normal((1, n_kv, n, head_dim))
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def section_reload(ctx: "Ctx") -> dict:
    import mlx.core as mx

    from ...pool import BlockPool
    from ...disk_format import FORMAT_VERSION
    from ...store import DiskStore

    plan = ctx.plan
    cfg = json.loads((ctx.model / "config.json").read_text())
    n_layers, n_kv, head_dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    root = ctx.work / "reload"
    say(f"reload: sequential read bandwidth ({plan.bandwidth_mb} MB file)")
    bw = measure_bandwidth(root / "bandwidth.bin", plan.bandwidth_mb, plan.reload_reps)
    say(f"  buffered after drop {bw['buffered_after_drop_mb_s']} MB/s, O_DIRECT {bw['o_direct_mb_s']} MB/s, "
        f"page cache {bw['page_cache_mb_s']} MB/s")
    from ...reads import READER_THREADS

    checks = measure_checksums(min(256, max(32, plan.bandwidth_mb // 4)), READER_THREADS)
    say(f"  sha256 {checks['sha256_mb_s']} MB/s on one thread, {checks['sha256_parallel_mb_s']} MB/s on "
        f"{READER_THREADS}")
    fingerprint = "bench" + hashlib.sha256(b"reload").hexdigest()
    fmt = {"format_version": FORMAT_VERSION, "bits": 4, "group_size": 64, "block_size": 256}

    def open_pool() -> BlockPool:
        store = DiskStore(root / "cache", fingerprint, {"model_type": cfg["model_type"], "n_layers": n_layers}, fmt)
        return BlockPool(fingerprint=fingerprint, n_layers=n_layers, bits=4, group_size=64, block_size=256,
                         hot_bytes=1 << 40, store=store)

    pool = open_pool()
    tokens: dict[int, list[int]] = {}
    for n in plan.reload_sizes:
        rng = random.Random(n)
        tokens[n] = [rng.randrange(4, cfg["vocab_size"]) for _ in range(n)]
        pool.commit(f"reload-{n}", tokens[n], _random_q4_cache(n_layers, n_kv, head_dim, n, n))
        pool.flush()
    # The same bytes as one file, read whole into fresh memory: what any reload that lands the data in
    # new memory needs at least on this machine (the bandwidth file is read into one reused buffer).
    one_files = {}
    for n in plan.reload_sizes:
        one_files[n] = root / f"one-file-{n}.bin"
        with open(one_files[n], "wb") as out:
            for b in pool.agent(f"reload-{n}").block_ids:
                out.write(pool.store.block_path(b).read_bytes())
            out.flush()
            os.fsync(out.fileno())
    pool.close()
    del pool
    warm = open_pool()  # first-use costs (MLX kernels, allocations) are not a reload's
    warm.load_manifests()
    warm.lookup(f"reload-{plan.reload_sizes[0]}", tokens[plan.reload_sizes[0]] + [1])
    warm.close()
    del warm
    rows = []
    for rep in range(plan.reload_reps):
        for n in plan.reload_sizes:
            ns = f"reload-{n}"
            pool = open_pool()
            pool.load_manifests()
            ids = list(pool.agent(ns).block_ids)
            files = [pool.store.block_path(b) for b in ids]
            nbytes = sum(f.stat().st_size for f in files)
            drop = drop_page_cache(files)
            t = time.perf_counter()
            cache, covered, tier = pool.lookup(ns, tokens[n] + [1])
            cold_s = time.perf_counter() - t
            kv_bytes = sum(c.nbytes for c in cache) if cache else 0
            pool.close()
            del cache, pool
            if covered != n or tier != "disk":
                raise RuntimeError(f"reload of {n} tokens covered {covered} from {tier}")
            # the store alone: read + verify every block file, no MLX
            drop_page_cache(files)
            store = DiskStore(root / "cache", fingerprint, {"model_type": cfg["model_type"], "n_layers": n_layers}, fmt)
            t = time.perf_counter()
            for b in ids:
                store.read_block(b)
            read_s = time.perf_counter() - t
            drop_page_cache([one_files[n]])
            t = time.perf_counter()
            with open(one_files[n], "rb", buffering=0) as f:
                f.readinto(bytearray(one_files[n].stat().st_size))
            one_s = time.perf_counter() - t
            # page cache warm: what a reload costs when the OS still holds the files
            pool = open_pool()
            pool.load_manifests()
            t = time.perf_counter()
            cache, covered, tier = pool.lookup(ns, tokens[n] + [1])
            warm_s = time.perf_counter() - t
            pool.close()
            del cache, pool
            mx.clear_cache()
            row = {"tokens": n, "rep": rep, "blocks": len(ids), "file_bytes": nbytes, "kv_bytes": kv_bytes,
                   "resident_after_drop": drop["resident_after"], "reload_s": round(cold_s, 5),
                   "store_read_s": round(read_s, 5), "reload_page_cache_s": round(warm_s, 5),
                   "one_file_read_s": round(one_s, 5)}
            rows.append(row)
            say(f"  {n:>6} tokens {nbytes / MB:7.1f} MB: reload {cold_s * 1e3:8.1f} ms "
                f"({nbytes / MB / cold_s:6.0f} MB/s), read+verify {read_s * 1e3:8.1f} ms, warm {warm_s * 1e3:7.1f} ms")
    summary = []
    for n in plan.reload_sizes:
        rs = [r for r in rows if r["tokens"] == n]
        mb = rs[0]["file_bytes"] / MB
        cold, read, warm, one = (median([r[k] for r in rs]) for k in ("reload_s", "store_read_s", "reload_page_cache_s",
                                                                      "one_file_read_s"))
        limit = mb / bw["buffered_after_drop_mb_s"]
        summary.append({
            "tokens": n, "file_mb": round(mb, 2), "reload_ms": round(cold * 1e3, 2),
            "reload_mb_s": round(mb / cold, 1), "store_read_ms": round(read * 1e3, 2),
            "reload_page_cache_ms": round(warm * 1e3, 2),
            "disk_limit_ms": round(limit * 1e3, 2), "reload_over_limit": round(cold / limit, 2),
            "one_file_read_ms": round(one * 1e3, 2), "reload_over_one_file": round(cold / one, 2),
        })
    shutil.rmtree(root / "cache", ignore_errors=True)
    for f in one_files.values():
        f.unlink()
    return {"bandwidth": bw, "checksums": checks, "rows": rows, "summary": summary,
            "layout": {"layers": n_layers, "kv_heads": n_kv, "head_dim": head_dim, "bits": 4, "group_size": 64,
                       "block_size": 256, "kv_dtype": "float32 scales/biases (the model's dtype)"}}


def md_reload(r: dict, plan: dict) -> list[str]:
    bw = r["bandwidth"]
    lay = r["layout"]
    L = ["## Reload against the physical limit", "",
         f"In-process: agents of each size committed through `BlockPool` into a `DiskStore` (layout of the served "
         f"model: {lay['layers']} layers, {lay['kv_heads']} KV heads, head_dim {lay['head_dim']}, 4-bit, group 64, "
         f"blocks of 256 tokens, {lay['kv_dtype']}). Reload = `BlockPool.lookup` on a freshly opened pool, after "
         "fsync + posix_fadvise(DONTNEED) on the agent's block files (mincore confirms what stayed resident); it "
         "reads (the branch's blocks in parallel on the reader threads), verifies (each block's checksum: crc32, "
         "sha256 before 2026-11-25), converts to MLX and concatenates. Read+verify = `DiskStore.read_block` for every "
         "block, one after another, no MLX. Page-cache reload = the same lookup without dropping the files. One-file "
         "read = the agent's block files concatenated into one file, dropped the same way and read whole into one "
         "fresh buffer: the least any reload into new memory costs here.", "",
         f"Sequential read bandwidth of the same disk, {bw['file_mb']} MB file: **{bw['buffered_after_drop_mb_s']} "
         f"MB/s** buffered after DONTNEED (resident after drop: {bw['resident_after_drop']}), "
         f"{bw['o_direct_mb_s']} MB/s with O_DIRECT, {bw['page_cache_mb_s']} MB/s from the page cache; "
         f"write+fsync {bw['write_fsync_mb_s']} MB/s. The disk limit below = size / buffered bandwidth.", ""]
    ck = r.get("checksums")
    if ck:
        L += [f"Integrity checks on this CPU, one thread: crc32 (what blocks carry) {ck['crc32_mb_s']} MB/s, "
              f"sha256 (before 2026-11-25) {ck['sha256_mb_s']} MB/s ({ck['sha256_parallel_mb_s']} MB/s on the "
              f"pool's {ck['threads']} reader threads), blake2b {ck['blake2b_mb_s']} MB/s.", ""]
    L += ["| tokens | file MB | reload ms | reload MB/s | read+verify ms | page-cache reload ms | disk limit ms | "
          "reload / limit | one-file read ms | reload / one-file read |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["summary"]:
        L.append(f"| {x['tokens']} | {x['file_mb']} | {x['reload_ms']} | {x['reload_mb_s']} | {x['store_read_ms']} | "
                 f"{x['reload_page_cache_ms']} | {x['disk_limit_ms']} | {x['reload_over_limit']} | "
                 f"{x.get('one_file_read_ms', '-')} | {x.get('reload_over_one_file', '-')} |")
    L += ["", "![Reload time against size](reload.png)", ""]
    return L
