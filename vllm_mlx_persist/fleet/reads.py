"""The tier's reads: an agent's manifest judged against this server's era, and blocks verified exactly
as disk blocks, in pipelined round trips; each on one of `read_threads` daemon threads, so a caller
gives up at its deadline (read_timeout_s) even on a hung socket. Any thread; numpy and bytes only."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

from ..chain import removals_of
from ..disk_format import (BLOCK_FORMAT, FORMAT_VERSION, BlockData, FormatError, block_metadata, decode_block,
                           header_length)
from .auth import Tagger
from .connection import Connection, RemoteUnavailable
from .eras import Eras
from .keyspace import BLOCK_CHECKSUM_KINDS, Keyspace
from .manifests import FIELDS, Manifests, RemoteManifest
from .settings import FleetSettings
from .state import TierState

logger = logging.getLogger("vllm_mlx_persist.fleet")

_FAILED = object()  # a read that did not reach Redis (as opposed to a key that is absent)


def _newer_block(data: Any) -> Optional[str]:
    """What a block value that failed decode_block says it is, when that is our block format in
    a version or with a checksum kind this build does not know (a value not ours to judge, so not
    to delete); None for anything else (damaged: its header does not parse or its checks fail)."""
    try:
        meta = block_metadata(data[8 : 8 + header_length(data[:8], len(data))])
        fmt, version, checksum = meta["format"], meta["format_version"], meta["checksum"]
    except (FormatError, KeyError):
        return None
    if fmt != BLOCK_FORMAT or not isinstance(version, str) or not isinstance(checksum, str):
        return None
    if version != str(FORMAT_VERSION) and version.isdigit():
        return f"block format version {version}"
    kind, sep, _ = checksum.partition(":")
    if sep and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", kind) and kind not in BLOCK_CHECKSUM_KINDS:
        return f"a block with a {kind} checksum"
    return None


class Reads:
    """`get_manifest`, `get_block`, `get_blocks`: None (or a shorter list) for every failure
    (absent, refused, not ours, Redis down or slow, breaker open), never an exception."""

    def __init__(self, settings: FleetSettings, keys: Keyspace, tagger: Tagger, manifests: Manifests,
                 conn: Connection, eras: Eras, state: TierState):
        self.read_timeout_s = settings.read_timeout_s
        self.fetch_blocks, self.fetch_bytes = settings.fetch_blocks, settings.fetch_bytes
        self.block_ttl_s = settings.block_ttl_s
        self.keys, self.tagger, self.manifests = keys, tagger, manifests
        self.conn, self.eras, self._state = conn, eras, state
        self._readers = ThreadPoolExecutor(settings.read_threads, thread_name_prefix="vllm-mlx-persist-remote-reader")
        self._read_slots = threading.BoundedSemaphore(settings.read_threads)
        # Admission checks (a fork's parent settings, read while a request waits to be admitted) have
        # a reader of their own: they never queue behind syncs' block fetches.
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="vllm-mlx-persist-remote-check")
        self._check_slot = threading.BoundedSemaphore(1)

    def get_manifest(self, namespace: str, timeout: Optional[float] = None,
                     check: bool = False) -> Optional[RemoteManifest]:
        """The agent's manifest in Redis (erased=True for a tombstone), judged against this server's
        era (RemoteManifest: erasure, outdated); None when absent, refused, not ours or unreachable
        within `timeout` (at most read_timeout_s). `check`: an admission check's read, on its own
        reader (skipped, None, while that reader is still busy with an earlier one)."""
        key = self.keys.manifest(namespace)
        state, eras = self._state, self.eras
        with state.lock:
            state.c["manifest_gets"] += 1
            if namespace in eras.pending_erase:
                return None  # erased here, not yet in Redis: never serve it back
            gen = eras.agent(namespace).gen
        raw = self._bounded_read(lambda: self.conn.client.hmget(key, *FIELDS), timeout, check)
        if raw is _FAILED:
            return None
        cur = self.manifests.judge(key, raw)
        if cur.state == "absent":
            return None
        if cur.state != "ok":
            self.manifests.refused(cur, "read")
            return None
        m = None if cur.erased else self.manifests.parse(cur.body, namespace)
        if m is None and not cur.erased:
            state.count("refused")
            return None
        era = cur.ident if m is None else (m.era or "")
        with state.lock:
            st = eras.agent(namespace)
            if st.gen != gen:
                # An erasure here, or one met, while this read ran: the value is judged against an
                # era that is no longer this server's. A miss; the next read judges it afresh.
                return None
            mine = st.era
            # Another era: a tombstone, or a history started after an erasure this server never
            # acted on (its copy predates it); none ('') while this server's has one: a history
            # from before the erasure this server's histories follow.
            erasure = era if era and not eras.meet_erasure(st, cur.version, era) else ""
            if m is None:
                return RemoteManifest(namespace, [], 0, 0.0, cur.version, erased=True, ident=cur.ident,
                                      seen=not erasure, era=era, erasure=erasure)
            state.c["manifest_hits"] += 1
            eras.was_read(st, cur.version, cur.ident)
            seen = st.seen_id == cur.ident
        branches = m.branches if m.branches is not None else [
            {"block_ids": list(m.block_ids), "n_tokens": m.n_tokens, "links": [[0, namespace]]}]
        return RemoteManifest(m.namespace, m.block_ids, m.n_tokens, m.updated_at, cur.version, branches=branches,
                              ident=cur.ident, seen=seen, era=era, erasure=erasure, outdated=not era and bool(mine),
                              removals=removals_of(m), spliced_cleared=m.spliced_cleared or 0.0,
                              forkable=m.forkable, pinned=m.pinned, settings_at=dict(m.settings_at or {}),
                              removed_floor=m.removed_floor or 0.0)

    def get_block(self, block_id: str) -> Optional[BlockData]:
        """The block, verified exactly as a disk block (disk_format.decode_block), and its MAC with a
        secret; None when absent, refused (damaged, another block's, or without a valid MAC: deleted
        from Redis if unchanged), of a format this build cannot read (left alone) or unreachable in time."""
        got = self.get_blocks([block_id])
        return got[0] if got else None

    def get_blocks(self, block_ids: Sequence[str], max_bytes: Optional[int] = None) -> list[BlockData]:
        """The blocks in order, each verified as `get_block` does, up to the first one absent,
        refused or not read in time, or once `max_bytes` of block data are held: the list is then
        shorter than asked. Read in pipelined round trips of at most `fetch_blocks` blocks and about
        `fetch_bytes` bytes (estimated from the largest block seen; one block until one was), each
        bounded by read_timeout_s."""
        keys = [self.keys.block(b) for b in block_ids]
        out: list[BlockData] = []
        held = 0
        while len(out) < len(keys) and (max_bytes is None or held < max_bytes):
            seen = self._state.block_size_seen
            n = max(1, min(self.fetch_blocks, self.fetch_bytes // seen)) if seen else 1
            batch = keys[len(out) : len(out) + n]
            with self._state.lock:
                self._state.c["gets"] += len(batch)
                self._state.c["fetch_round_trips"] += 1
            raws = self._bounded_read(lambda: self._get_many(batch))
            if raws is _FAILED:
                return out
            for key, raw in zip(batch, raws):
                if max_bytes is not None and held >= max_bytes:
                    return out
                block = self._verify(block_ids[len(out)], key, raw)
                if block is None:
                    return out
                out.append(block)
                held += block.nbytes
        return out

    def _get_many(self, keys: list[str]) -> list:
        pipe = self.conn.client.pipeline(transaction=False)
        for key in keys:
            if self.block_ttl_s > 0:
                pipe.getex(key, ex=self.block_ttl_s)  # a hit keeps the block alive
            else:
                pipe.get(key)
        return pipe.execute()

    def _verify(self, block_id: str, key: str, raw: Optional[bytes]) -> Optional[BlockData]:
        """A value read from Redis as a block, or None: absent; refused (its MAC missing or wrong, or
        damaged: deleted if unchanged, so a put can store a good copy); or not ours to judge (a
        newer format of ours: left in place)."""
        state = self._state
        if raw is None:
            state.count("misses")
            return None
        data, problem = self.tagger.unwrap_block(key, raw)
        if problem is not None:
            state.count("refused_mac")
            state.warn_once("block-mac", "fleet: refused a block from Redis whose MAC is %s (written without "
                            "this fleet's secret, or damaged); deleting it (further ones: debug log)", problem)
            self._refuse_block(block_id, key, raw, f"MAC {problem}", quiet=True)
            return None
        try:
            block = decode_block(data, block_id)
        except FormatError as e:
            newer = _newer_block(data)
            if newer is not None:
                state.count("foreign")
                state.warn_once("block-foreign", "fleet: block %s in Redis is %s, which this build cannot read; "
                                "left in place (a build of another format wrote it into this keyspace; "
                                "further ones: debug log)", block_id, newer)
                return None
            self._refuse_block(block_id, key, raw, str(e))
            return None
        with state.lock:
            state.c["hits"] += 1
            state.c["bytes_down"] += len(raw)
            state.block_size_seen = max(state.block_size_seen, len(raw))
        return block

    def _refuse_block(self, block_id: str, key: str, raw: bytes, why: str, quiet: bool = False) -> None:
        self._state.count("refused")
        (logger.debug if quiet else logger.warning)("fleet: refused block %s from Redis (%s); deleting it",
                                                    block_id, why)
        digest = hashlib.sha1(raw).hexdigest()
        self._bounded_read(lambda: self.conn.del_if_script(self.conn.client, [key], [digest]))

    def _bounded_read(self, fn: Callable[[], Any], timeout: Optional[float] = None, check: bool = False) -> Any:
        """Run a Redis read on a reader thread (`check`: the admission checks' own); _FAILED on any
        failure or after `timeout` (at most read_timeout_s)."""
        conn = self.conn
        limit = self.read_timeout_s if timeout is None else min(timeout, self.read_timeout_s)
        slots, readers = (self._check_slot, self._checker) if check else (self._read_slots, self._readers)
        if conn.disabled or self._state.stop or not conn.breaker.allow():
            self._state.count("skipped")
            return _FAILED
        if not slots.acquire(blocking=False):
            self._state.count("skipped")  # every reader is stuck on a slow Redis: do not queue behind it
            return _FAILED

        def job() -> Any:
            try:
                conn.ensure_model(conn.client)
                return fn()
            finally:
                slots.release()

        try:
            fut = readers.submit(job)
        except RuntimeError:  # executor shut down by close()
            slots.release()
            self._state.count("skipped")
            return _FAILED
        try:
            result = fut.result(timeout=limit)
        except FutureTimeout:
            if limit < self.read_timeout_s:
                # the caller's shorter bound, not Redis's failure: the breaker is left to full reads
                self._state.count("timeouts")
                logger.debug("fleet: a read gave up after the caller's %.2fs", limit)
                return _FAILED
            conn.failed("timeouts", "read timed out after %.2fs" % limit, transport=True)
            return _FAILED
        except RemoteUnavailable:
            self._state.count("skipped")
            return _FAILED
        except conn.redis_errors as e:  # the socket's own time-out may fire first: still a time-out
            conn.failed("timeouts" if isinstance(e, conn.timeout_errors) else "errors", e,
                        transport=isinstance(e, conn.transport_errors))
            return _FAILED
        conn.succeeded()
        return result

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._checker.shutdown(wait=False, cancel_futures=True)
