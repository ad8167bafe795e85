"""This server's view of each agent in Redis: the value it holds (published, adopted, or erased its
copy for), the erasure it follows (its era: docs/fleet.md, Erasure), an erasure met and not yet acted
on, the versions read lately, and the erasures queued. No Redis, no I/O: O(1) for any thread, under
the tier's lock (state.TierState); the reads and the writer judge values against it."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from ..disk_format import check_era
from .state import TierState

_READ_IDS = 4  # versions -> ids of the last manifests read per agent, for adopt()


@dataclass
class AgentState:
    # The value this server last published, adopted, or erased its copy for: a put whose base it is
    # succeeds it (a sequential successor). Compared by id, never by version alone: versions start
    # again from the writer's memory once a key expires, so equal versions can be different values.
    seen_v: int = -1
    seen_id: str = ""
    # The newest erasure met (a tombstone, or a history of another era: read, or refusing a put) that
    # this server has not yet erased its copy for (erased_locally): until then every put of the
    # agent is refused by it.
    tomb_v: int = -1
    tomb_id: str = ""
    # The erasure this server's histories of the agent follow: the id of the last tombstone it wrote
    # (its own erasure) or erased its copy for; '' none. Every put carries it (docs/fleet.md, Erasure).
    era: str = ""
    read: dict = field(default_factory=dict)  # version -> id of the last live manifests read (adopt)
    gen: int = 0  # changes on every erasure seen here: queued puts from before it are stale


class Eras:
    """The agents' states (LRU-bounded by `max_agents`; a forgotten one is simply 'never seen') and
    the erasures queued (`pending_erase`: namespace -> how many). Methods marked (lock held) are
    called with `state.lock` held; the others take it."""

    def __init__(self, state: TierState, max_agents: int):
        self._lock = state.lock
        self.max_agents = max_agents
        self._agents: "OrderedDict[str, AgentState]" = OrderedDict()
        self.pending_erase: dict[str, int] = {}  # namespace -> erasures queued
        self._gen_counter = 0

    # ---- this server's view of an agent (O(1), no Redis) -------------------------------------------

    def seen_version(self, namespace: str) -> int:
        """The version of the manifest this server last published, adopted or erased its copy
        for; -1: none."""
        with self._lock:
            st = self._agents.get(namespace)
            return -1 if st is None else st.seen_v

    def adopt(self, namespace: str, version: int) -> None:
        """This server now holds the agent's manifest `version`, as get_manifest returned it, as its
        own history: its next put for the agent is a sequential successor of that value. (A version
        this tier did not read lately, or older than what it holds, is ignored.)"""
        with self._lock:
            st = self.agent(namespace)
            ident = st.read.get(int(version))
            if ident is not None and int(version) >= st.seen_v:
                st.seen_v, st.seen_id = int(version), ident

    def release(self, namespace: str) -> None:
        """This server no longer holds the agent's history (it erased its copy: a local space
        decision, or before erased_locally): its next put is nobody's sequential successor, so it
        merges with what Redis holds instead of replacing it."""
        with self._lock:
            st = self._agents.get(namespace)
            if st is not None:
                st.seen_id = ""

    def erased_locally(self, namespace: str, ident: str) -> bool:
        """This server has erased its copy of the agent (memory and disk, durable) because of the
        erasure `ident` (RemoteManifest.erasure, or on_erased's second argument). Until this is
        called every put of the agent meets that erasure and is refused; from now on this server's
        era for the agent is `ident`: a put starts a new history on top of that tombstone, or joins
        the history of that era in Redis. Puts queued before are discarded. False (nothing changes)
        if a newer erasure has been met or made here since: its own erasure follows."""
        with self._lock:
            st = self.agent(namespace)
            if not ident or ident != st.tomb_id or namespace in self.pending_erase:
                return False
            # Onto a tombstone its id is the base (a successor starts a new history); a history of
            # that era in Redis is no base of this server's: its next put merges with it.
            st.seen_v, st.seen_id = st.tomb_v, st.tomb_id
            st.era = st.tomb_id
            st.tomb_v, st.tomb_id = -1, ""
            self.bump_gen(namespace)
            return True

    def era(self, namespace: str) -> str:
        """The erasure this server's histories of the agent follow: the id of the last tombstone it
        wrote or erased its copy for ('' none, or forgotten). Stamped in the local manifests (a
        restart tells it back with known_era); every put carries it."""
        with self._lock:
            st = self._agents.get(namespace)
            return "" if st is None else st.era

    def known_era(self, namespace: str, era: Optional[str]) -> None:
        """Start-up: this server's copy of the agent on its disk follows erasure `era` (its local
        manifest says so). Ignored when this tier already knows an era for the agent (it is newer)."""
        if era:
            check_era(era)
            with self._lock:
                st = self.agent(namespace)
                if not st.era:
                    st.era = era

    # ---- the reads' and the writer's bookkeeping (lock held) ---------------------------------------

    def agent(self, namespace: str) -> AgentState:
        """(lock held) This server's state for an agent (LRU-bounded; a forgotten one is simply 'never seen')."""
        st = self._agents.get(namespace)
        if st is None:
            st = self._agents[namespace] = AgentState()
            if len(self._agents) > self.max_agents:
                self._agents.popitem(last=False)
        else:
            self._agents.move_to_end(namespace)
        return st

    def bump_gen(self, namespace: str) -> None:
        """(lock held)"""
        self._gen_counter += 1
        self.agent(namespace).gen = self._gen_counter

    def meet_erasure(self, st: AgentState, version: int, ident: str) -> bool:
        """(lock held) Erasure `ident` (a tombstone's id, or the era of a history: read, or refusing a
        put; `version`: that value's) was met: whether this server already acted on it (it is this
        server's era). A new one is remembered until erased_locally; puts queued before it are stale
        (it would refuse them)."""
        if ident == st.era:
            return True
        if ident != st.tomb_id:
            st.tomb_v, st.tomb_id = version, ident
            self._gen_counter += 1
            st.gen = self._gen_counter
        return False

    def was_read(self, st: AgentState, version: int, ident: str) -> None:
        """(lock held) A live manifest `version` (value `ident`) was read: adopt() may take it."""
        st.read[version] = ident
        while len(st.read) > _READ_IDS:
            del st.read[next(iter(st.read))]

    def erasing(self, namespace: str, ident: Optional[str] = None) -> None:
        """(lock held) An erasure of the agent is queued here: queued puts from before it are stale,
        and the tombstone's id is chosen now: turns made after this call follow this erasure. An
        erasure met earlier and not yet acknowledged is superseded (erased_locally refuses it).
        `ident`: the tombstone's id when chosen already (an erasure in the outbox, queued again)."""
        self.bump_gen(namespace)
        st = self.agent(namespace)
        st.era, st.tomb_v, st.tomb_id = ident or secrets.token_hex(8), -1, ""
        self.pending_erase[namespace] = self.pending_erase.get(namespace, 0) + 1

    def erased(self, namespace: str, version: int, ident: str) -> None:
        """(lock held) The erasure's tombstone (`version`, `ident`) is in Redis (`ident` "": and a history
        begun on it since, which is not this server's)."""
        st = self.agent(namespace)
        st.seen_v, st.seen_id = version, ident  # puts queued after the erasure may recreate the agent
        st.tomb_v, st.tomb_id = -1, ""
        left = self.pending_erase.get(namespace, 1) - 1
        if left > 0:
            self.pending_erase[namespace] = left
        else:
            self.pending_erase.pop(namespace, None)
