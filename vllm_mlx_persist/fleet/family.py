"""Servers of one model's weights whose keyspaces differ by key format (issue #53 item 4).

The keyspace is named by the model fingerprint, and the fingerprint includes the key format (its
calibrated scales too): two servers of the same weights, one storing keys as q4 and one as k8v4 (a
rolling change of the option, or `auto` choosing differently on two hosts), share no K/V, and an
erasure in one keyspace never reached the other. Their K/V cannot be read across formats, so they
stay apart; what this module adds:

- every tier registers its keyspace under its weights' family: the hash
  `<key_prefix>:family:<weights[:32]>` (weights: the fingerprint with keys as q4, the same for every
  key format), field the keyspace's fingerprint, value a JSON line (key format, when registered),
  tagged as the tier tags values (a member with a bad tag is ignored);
- a family of more than one keyspace is a mixed fleet: logged at WARNING once per other keyspace,
  and reported (`stats`: /v1/status under remote, /health's cache_backend detail);
- an erasure reaches every keyspace of the family: a tombstone in each other one (`erase`), which
  their servers act on as on any other server's erasure; `holds` tells whether another keyspace
  holds a live manifest of the agent (so DELETE on a server that never served it is not a 404).

Redis I/O on the caller's thread (sync threads, the admin thread, the tier's writer thread), bounded
by the tier's client time-outs; no lock held across it. Raises the tier's Redis errors from `erase`
(its caller keeps the erasure pending); the other calls never raise for a Redis fault.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Optional

from ..disk_format import canonical_json
from .keyspace import Keyspace
from .manifests import FIELDS, Manifests

log = logging.getLogger("vllm_mlx_persist.fleet")

REFRESH_S = 30.0  # how often the family is read again (on a sync; an erasure always reads it)
_CAS_TRIES = 16


class Family:
    """One tier's view of the keyspaces of its weights (see the module docstring)."""

    def __init__(self, tier: Any, weights: str, key_format: str, clock=time.monotonic):
        if not isinstance(weights, str) or len(weights) < 32:
            raise ValueError("weights fingerprint must be a string of at least 32 characters")
        self.tier, self.weights, self.key_format, self.clock = tier, weights, key_format, clock
        self.key = f"{tier.settings.key_prefix}:family:{weights[:32]}"
        self.registered = threading.Event()
        self._lock = threading.Lock()
        self._others: dict[str, dict] = {}  # fingerprint -> its JSON value (key_format, at)
        self._read_at: Optional[float] = None
        self._warned: set[str] = set()
        self.counts = {"family_erasures": 0, "family_erasure_failures": 0}

    # ---- registration and detection ----------------------------------------------------------------

    def _value(self) -> bytes:
        return canonical_json({"key_format": self.key_format, "at": round(time.time(), 3)})

    def _tag(self, field: str, value: bytes) -> bytes:
        return self.tier.tagger.tag(b"family", self.key, [field.encode(), value])

    def register(self) -> bool:
        """Claim this tier's keyspace in the family (idempotent); False when Redis did not answer."""
        fp, value = self.tier.fingerprint, self._value()
        try:
            self.tier.conn.client.hset(self.key, mapping={fp: value, fp + ":m": self._tag(fp, value)})
        except self.tier.conn.redis_errors as e:
            log.debug("fleet: registering the keyspace's key format failed: %s", e)
            return False
        self.registered.set()
        return True

    def refresh(self, force: bool = False, strict: bool = False) -> dict[str, dict]:
        """The other keyspaces of these weights (fingerprint -> what they registered), read again when
        `force` or older than REFRESH_S (and, unless forced, Redis not known down: the tier's breaker);
        registers this one first if it has not yet. Never raises, unless `strict` (then a failed read
        raises the tier's Redis error instead of answering what the last read found)."""
        now = self.clock()
        with self._lock:
            due = force or self._read_at is None or now - self._read_at >= REFRESH_S
            if not due or (not force and not self.tier.conn.breaker.allow()):  # Redis known down: not waited on
                return dict(self._others)
            self._read_at = now
        if not self.registered.is_set():
            self.register()
        try:
            raw = self.tier.conn.client.hgetall(self.key)
        except self.tier.conn.redis_errors as e:
            log.debug("fleet: reading the weights' keyspaces failed: %s", e)
            if strict:
                raise
            with self._lock:
                return dict(self._others)
        others = {}
        for k, v in raw.items():
            field = k.decode("ascii", "replace")
            if field.endswith(":m") or field == self.tier.fingerprint:
                continue
            tag = raw.get((field + ":m").encode())
            if self.tier.tagger.check(tag, b"family", self.key, [field.encode(), v]) is not None:
                continue  # not written by a server of this fleet's secret, or damaged
            try:
                info = json.loads(v)
            except ValueError:
                continue
            if isinstance(info, dict) and len(field) >= 32 and all(c in "0123456789abcdef" for c in field):
                others[field] = info
        with self._lock:
            self._others = others
            new = [fp for fp in others if fp not in self._warned]
            self._warned.update(new)
        for fp in new:
            log.warning("fleet: MIXED FLEET: servers of this model's weights store keys as %r here and as %r in "
                        "keyspace %s: they share no K/V (erasures are written to every keyspace of the weights); "
                        "set the same key_format on every server (docs/fleet.md, Key formats)",
                        self.key_format, others[fp].get("key_format"), fp[:16])
        return dict(others)

    def stats(self) -> dict:
        """What the last read found (O(1), no I/O)."""
        with self._lock:
            formats = sorted({str(i.get("key_format")) for i in self._others.values()} | {self.key_format})
            return {"key_format": self.key_format, "key_formats": formats, "mixed_key_formats": bool(self._others),
                    "keyspaces_of_weights": 1 + len(self._others), **self.counts}

    # ---- erasure across keyspaces ------------------------------------------------------------------

    def _sibling(self, fp: str) -> tuple[Keyspace, Manifests]:
        tier = self.tier
        return Keyspace(tier.settings.key_prefix, fp, tier.tagger), Manifests(tier.tagger, fp, tier._state)

    def holds(self, namespace: str) -> bool:
        """Whether another keyspace of these weights holds a live manifest of the agent (the family read
        again first). Never raises."""
        for fp in self.refresh(force=True):
            keys, manifests = self._sibling(fp)
            key = keys.manifest(namespace)
            try:
                cur = manifests.judge(key, self.tier.conn.client.hmget(key, *FIELDS))
            except self.tier.conn.redis_errors:
                continue
            if cur.state == "ok" and not cur.erased:
                return True
        return False

    def erase(self, namespace: str, ident: str) -> None:
        """Write erasure `ident`'s tombstone into every other keyspace of these weights (one version above
        what each holds), as their own servers' erasures are written. Raises the tier's Redis errors."""
        try:
            self._erase(namespace, ident)
        except Exception:
            with self._lock:
                self.counts["family_erasure_failures"] += 1
            raise

    def _erase(self, namespace: str, ident: str) -> None:
        tier = self.tier
        client = tier.conn.write_client
        for fp, info in self.refresh(force=True, strict=True).items():
            keys, manifests = self._sibling(fp)
            key = keys.manifest(namespace)
            for _ in range(_CAS_TRIES):
                cur = manifests.judge(key, client.hmget(key, *FIELDS))
                if cur.state == "ok" and cur.erased and cur.ident == ident:
                    break  # written already (even when absent a tombstone goes: a server cut off may hold a copy)
                theirs = manifests.parse(cur.body, namespace) if cur.state == "ok" and not cur.erased else None
                if theirs is not None and theirs.era == ident:
                    break  # written already, and a history begun on it since: newer than the erasure, it stays
                version = max(cur.version if cur.state == "ok" else -1, 0) + 1
                fields = manifests.fields(key, version, ident, True)
                if int(tier.writer._cas_script(client, [key], [cur.raw_id, tier.settings.tombstone_ttl_s, *fields])):
                    with self._lock:
                        self.counts["family_erasures"] += 1
                    log.info("fleet: an erasure written to the keyspace of key format %r too (%s)",
                             info.get("key_format"), fp[:16])
                    break
            else:
                raise tier.conn.redis_errors[0](f"a manifest changed under its erasure {_CAS_TRIES} times")
