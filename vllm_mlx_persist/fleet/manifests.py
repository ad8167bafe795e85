"""The replicated agent: a manifest value in Redis (its fields, tag, body, digest), judged as a reader
or the writer finds it, and the rules deciding which of two updates wins and how two histories merge
(docs/fleet.md, "Which update wins", Erasure). Pure but for counting and logging refusals; any thread."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..chain import Copy, Removal, branches_of, manifest_of, merge_branches, merge_records, removals_of, same_branches
from ..disk_format import (FORMAT_VERSION, MAX_REMOVALS, RECORD_FIELDS, BlockData, Manifest, canonical_json,
                           check_block_id, check_branches, check_era, check_removals)
from ..record_settings import check_settings_at, differ, merge_records_settings
from .auth import Tagger
from .state import TierState

logger = logging.getLogger("vllm_mlx_persist.fleet")

_MANIFEST_FORMAT = "vllm-mlx-persist.remote-manifest"
FIELDS = ("v", "i", "e", "n", "d", "body", "m")  # a manifest hash's fields (docs/fleet.md)


@dataclass
class RemoteManifest:
    """An agent's manifest as Redis holds it. `erased`: a tombstone (no blocks).

    `block_ids` lists every block the manifest names (newest branch first), `n_tokens` is the
    newest branch's, and `branches` is the agent's branches, least recently used first, in the
    disk manifest's schema ({"block_ids", "n_tokens", "links"}, docs/disk-format.md): one plain
    chain seeded with the agent for a manifest without branches (an agent that never branched or
    forked). `ident` names this very value (fresh for every value written); `seen`: this server
    already holds it (published or adopted it, or, for a tombstone, erased its copy because of it).

    `era`: the erasure the value's history follows (the id of the tombstone it was started on; ''
    none; a tombstone's is its own id). `erasure`: an erasure this server has not acted on, which it
    must act on before it uses the value (erase its copy, then `erased_locally(agent, erasure)`): an
    unseen tombstone's id, or the era of a history started after an erasure this server never
    acted on. `outdated`: a history from before the erasure this server's histories follow (it
    says none while this server's era is one): nothing of it may be used, and this server's next
    put replaces it (docs/fleet.md, Erasure)."""

    namespace: str
    block_ids: list[str]
    n_tokens: int
    updated_at: float
    version: int
    erased: bool = False
    branches: list = field(default_factory=list)
    ident: str = ""
    seen: bool = False
    era: str = ""
    erasure: str = ""
    outdated: bool = False
    removals: tuple[Removal, ...] = ()  # content forget edits removed (chain.Removal): merges apply them
    spliced_cleared: float = 0.0  # spliced branches used at or before this are removed too
    forkable: Optional[bool] = None  # the record's settings, and when each was set (record_settings.py)
    pinned: bool = False
    settings_at: dict = field(default_factory=dict)
    removed_floor: float = 0.0  # what compacted removal records removed (chain.bound_removals)


@dataclass
class Current:
    """A manifest key's value as the writer or a reader found it, judged: `state` is 'absent',
    'ok', 'refused' (its tag is missing or wrong, or it is malformed: not a value of this fleet) or
    'foreign' (a tag of a kind this build does not know, without a secret: left alone)."""

    state: str
    raw_id: bytes = b""  # its i field as stored: what the compare-and-set expects
    version: int = -1
    ident: str = ""
    erased: bool = False
    n_tokens: int = -1
    digest: str = ""
    body: Optional[bytes] = None
    why: str = ""


class Manifests:
    """One tier's manifest values: judged (`judge`, `refused`), written (`fields`, `body`) and read
    (`parse`), tagged by `tagger`, for the model `fingerprint`."""

    def __init__(self, tagger: Tagger, fingerprint: str, state: TierState):
        self.tagger, self.fingerprint, self._state = tagger, fingerprint, state

    def judge(self, key: str, values: Sequence[Optional[bytes]]) -> Current:
        """A manifest key's fields (FIELDS, as HMGET returns them), judged."""
        v, i, e, n, d, body, tag = values
        if all(x is None for x in values):
            return Current("absent")
        raw_id = i or b""
        problem = self.tagger.check(tag, b"manifest", key, [x or b"" for x in values[:-1]])
        if problem == "unknown" and not self.tagger.authenticated:
            return Current("foreign", raw_id, why="a tag of an unknown kind")
        if problem is not None:
            return Current("refused", raw_id, why=f"its tag is {problem}")
        try:
            erased = e == b"1"
            cur = Current("ok", raw_id, int(v), raw_id.decode("ascii"), erased, 0 if erased else int(n),
                          (d or b"").decode("ascii"), body)
            if not cur.ident or e not in (b"0", b"1") or (not erased and body is None):
                raise ValueError("missing fields")
            check_era(cur.ident)  # a tombstone's id becomes an era, stamped in local manifests
        except (TypeError, ValueError) as err:
            return Current("refused", raw_id, why=f"malformed ({err})")
        return cur

    def refused(self, cur: Current, where: str) -> None:
        """Count and log (once at WARNING) a value judged 'refused' or 'foreign'."""
        if cur.state == "foreign":
            self._state.count("foreign")
            self._state.warn_once("manifest-foreign", "fleet: a manifest in Redis has %s; left alone (%s; further "
                                  "ones: debug log)", cur.why, where)
            return
        with self._state.lock:
            self._state.c["refused"] += 1
            if cur.why.startswith("its tag"):
                self._state.c["refused_mac"] += 1
        self._state.warn_once("manifest-refused", "fleet: refused a manifest from Redis: %s (%s; written without "
                              "this fleet's secret, or damaged; further ones: debug log)", cur.why, where)

    def fields(self, key: str, version: int, ident: str, erased: bool, n_tokens: int = 0,
               digest: str = "", body: bytes = b"") -> list[bytes]:
        """The field/value pairs of a manifest (or, `erased`, a tombstone: no n, d, body) with its tag."""
        vals = [str(version).encode(), ident.encode(), b"1" if erased else b"0"]
        vals += [b"", b"", b""] if erased else [str(n_tokens).encode(), digest.encode(), body]
        out: list[bytes] = []
        for name, val in zip(FIELDS, vals):
            if val or name in ("v", "i", "e"):
                out += [name.encode(), val]
        return out + [b"m", self.tagger.tag(b"manifest", key, vals)]

    def parse(self, body: Optional[bytes], namespace: str) -> Optional[Manifest]:
        try:
            d = json.loads(body)
            checksum = d.pop("checksum")
            if checksum != "sha256:" + hashlib.sha256(canonical_json(d)).hexdigest():
                raise ValueError("checksum mismatch")
            if d.get("format") != _MANIFEST_FORMAT or d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {d.get('format')!r} version {d.get('format_version')!r}")
            if d.get("fingerprint") != self.fingerprint:
                raise ValueError("another model's manifest")
            if d.get("namespace") != namespace:
                raise ValueError("another agent's manifest")
            ids, n, ts = d["block_ids"], d["n_tokens"], d["updated_at"]
            if not isinstance(ids, list) or not isinstance(n, int) or not isinstance(ts, (int, float)):
                raise ValueError("malformed fields")
            for b in ids:
                check_block_id(b)
            branches = d.get("branches")  # absent: one plain chain (and every older server's manifest)
            removals, cleared, forkable = d.get("removals"), d.get("spliced_cleared"), d.get("forkable")
            settings_at, floor, pinned = d.get("settings_at"), d.get("removed_floor"), d.get("pinned", False)
            if branches is not None:
                check_branches(branches, set(ids), allow_empty=True)  # a record may keep only removals
                if (branches[-1]["n_tokens"] if branches else 0) != n:
                    raise ValueError("n_tokens is not the newest branch's")
            era = d.get("era")  # absent: a history that never met an erasure (and every older server's)
            if era is not None:
                check_era(era)
            if removals is not None:
                check_removals(removals)
            if cleared is not None and (isinstance(cleared, bool) or not isinstance(cleared, (int, float))):
                raise ValueError("malformed spliced_cleared")
            if forkable is not None and not isinstance(forkable, bool):
                raise ValueError("malformed forkable")
            if settings_at is not None:
                check_settings_at(settings_at)
            if not isinstance(pinned, bool):
                raise ValueError("malformed pinned")
            if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float))):
                raise ValueError("malformed removed_floor")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("fleet: refused a manifest from Redis: %s", e)
            return None
        return Manifest(namespace, list(ids), n, float(ts), pinned, branches=branches, era=era, removals=removals,
                        spliced_cleared=cleared, forkable=forkable, settings_at=settings_at, removed_floor=floor)

    def body(self, m: Manifest, era: Optional[str] = None) -> bytes:
        """A manifest's body as Redis holds it; `era` (default: the manifest's) the erasure its history follows."""
        d = {"format": _MANIFEST_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
             "namespace": m.namespace, "block_ids": list(m.block_ids), "n_tokens": int(m.n_tokens),
             "updated_at": float(m.updated_at)}
        if m.branches is not None:  # optional, as on disk: plain manifests read as before everywhere
            d["branches"] = m.branches
        era = m.era if era is None else era
        if era:  # optional too: every r2 reader before it ignores it (docs/fleet.md, Versions)
            d["era"] = era
        if m.settings_at and "pinned" in m.settings_at:  # a pin set since pins travel (record_settings.py)
            d["pinned"] = bool(m.pinned)
        for name in RECORD_FIELDS:  # the record's (r3), each optional
            if getattr(m, name) is not None:
                d[name] = getattr(m, name)
        d["checksum"] = "sha256:" + hashlib.sha256(canonical_json(d)).hexdigest()
        return canonical_json(d)


# ---- which update wins, and the merge --------------------------------------------------------------


def decide(cur: Current, seen_v: int, seen_id: str, digest: str, base_digest: Optional[str] = None,
           era: str = "", cur_era: str = "") -> tuple[str, int]:
    """Which update wins (docs/fleet.md): (outcome, version), outcome one of publish (as that
    version), merge (a concurrent update: the union of both histories by recency, as that
    version), same, erased (a tombstone, or a history of another era: an erasure this server
    has not acted on), outdated (a history from before the erasure this put's era follows:
    replaced, as that version), foreign (a value this build cannot judge: left alone). `era`:
    the put's; `cur_era`: the current value's (a tombstone's is its own id)."""
    if cur.state == "foreign":
        return "foreign", -1
    if cur.state != "ok":  # absent, or no value of this fleet's (refused): as if absent
        return "publish", max(seen_v, 0) + 1
    if cur_era != era:
        if cur.erased or cur_era:  # an erasure this server never acted on: its copy predates it
            return "erased", cur.version
        return "outdated", cur.version + 1  # no era: none of it may come back
    if cur.ident == seen_id or cur.erased:  # a sequential successor (onto its own era's tombstone: a new history)
        return "publish", cur.version + 1
    if cur.digest == digest:
        return "same", cur.version
    if base_digest is not None and cur.digest == base_digest:  # it continued what Redis holds
        return "publish", cur.version + 1
    return "merge", cur.version + 1


def merged(m: Manifest, theirs: Optional[Manifest], branches: int, keep_continued: bool,
           blocks: Optional[dict] = None) -> Optional[Manifest]:
    """The put's record merged with the current manifest's (`theirs`, parsed): branches by recency
    (chain.merge_branches: a branch another holds goes, the `branches` most recently used stay),
    then what either side's removal records remove goes (removals win, docs/fleet.md; a grown
    partial tail is told by the tokens of the put's `blocks`), as a manifest; None when that is the
    current manifest itself (a late put of turns it already holds). A current body that does not
    parse (None) is no history to keep: the put as it is. `keep_continued`: a model with bounded
    sliding windows (see chain.merge_branches)."""
    if theirs is None:
        return m
    old = branches_of(theirs)
    new = merge_branches(old, branches_of(m), branches,  # on equal last use, the put's is newer
                         continued=not keep_continued)
    given = {b: d.tokens for b, d in (blocks or {}).items() if isinstance(d, BlockData)}
    new, removals, cleared, floor = merge_records(new, copy_of(m), copy_of(theirs), MAX_REMOVALS, 0.0, given.get)
    values, times = merge_records_settings(m, theirs)
    if (same_branches(new, old) and set(removals) == set(removals_of(theirs))
            and cleared == (theirs.spliced_cleared or 0.0) and floor == (theirs.removed_floor or 0.0)
            and not differ(values, times, theirs)):
        return None
    return manifest_of(m.namespace, new, values["pinned"], max(m.updated_at, theirs.updated_at), removals=removals,
                       spliced_cleared=cleared, forkable=values["forkable"], settings_at=times, removed_floor=floor)


def copy_of(m: Manifest) -> Copy:
    """A manifest's record as a copy to merge (chain.merge_records)."""
    return Copy(tuple(branches_of(m)), removals_of(m), m.spliced_cleared or 0.0, m.forkable, m.settings_at,
                m.removed_floor or 0.0, m.pinned)


def digest(m: Manifest) -> str:
    """What makes two puts 'the same history' for the script: the block ids, and the branches
    when there are any, without their last uses (recency is not history; and so a digest is
    what servers from before last uses compute)."""
    text = "\n".join(m.block_ids)
    if m.branches is not None:
        text += "\n" + canonical_json([{k: v for k, v in br.items() if k not in ("last_used", "made")}
                                    for br in m.branches]).decode()
    record = {k: getattr(m, k) for k in RECORD_FIELDS if getattr(m, k) is not None}
    if record:  # what a record holds besides branches is history too (a removal must be published)
        text += "\n" + canonical_json(record).decode()
    return hashlib.sha256(text.encode()).hexdigest()


def content(m: Manifest) -> set:
    """A manifest's branches as a set of (block ids, tokens), recency and order aside."""
    return {(tuple(br.block_ids), br.n_tokens) for br in branches_of(m)}
