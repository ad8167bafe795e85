"""A request's route: which agent, forking from which parent, with which span-directive mode.

The plugin builds a `Route` from a request's headers and metadata (plugin.py) and hands vllm-mlx its
one-string encoding (`Route.encode`), which the seam carries opaquely as `cache_namespace`; the
backend turns it back into a `Route` once per request (`Route.parse`) and everything after (the
pool, the span directives, the admin API) takes the typed value. An agent id is 1 to 128
characters from `[A-Za-z0-9._:@-]`, starting with a letter or digit, so never NUL: the parent and
the mode ride after NUL-led separators, `agent[\\0fork:parent][\\0edit:mode]`.

Chain seeds: an agent's spliced histories (span directives) are branches of the agent itself, with
their rotation generation (chain.Branch.generation); their block ids are seeded apart from any
honest prefill's with `spliced_seed(agent, g)` (the same string the layout before the agent record
stored them under, so their ids are unchanged). `legacy_spliced` reads that old layout's
namespaces, for the migration at load only (pool.load_manifests, offline.py).

Pure and stateless (no MLX, no vllm-mlx): any module, any thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

MAX_AGENT_ID_LEN = 128
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
FORK_SEPARATOR = "\0fork:"
EDIT_SEPARATOR = "\0edit:"
SPLICED_SEPARATOR = "\0amortized:"
LEGACY_GENERATIONS = 16  # kv_edit.max_rotations at most: the spliced namespaces the earlier layout could have


def validate_agent_id(agent_id: Any, source: str) -> str:
    """Return `agent_id` if it is a well-formed agent id, else raise ValueError naming `source`."""
    if not isinstance(agent_id, str):
        raise ValueError(f"agent id from {source} must be a string, got {type(agent_id).__name__}")
    if not 1 <= len(agent_id) <= MAX_AGENT_ID_LEN:
        raise ValueError(f"agent id from {source} must be 1 to {MAX_AGENT_ID_LEN} characters long")
    if not AGENT_ID_RE.fullmatch(agent_id):
        raise ValueError(
            f"agent id from {source} may only contain letters, digits and . _ : @ - "
            f"and must start with a letter or digit: {agent_id[:40]!r}"
        )
    return agent_id


@dataclass(frozen=True)
class Route:
    """Where a request's cache comes from and goes to. `agent` None: the anonymous namespace (then
    neither a parent nor a mode). `edit`: None (exact) or a kv_edit mode ("forget", "amortize")."""

    agent: Optional[str] = None
    fork_from: Optional[str] = None
    edit: Optional[str] = None

    def encode(self) -> Optional[str]:
        """The cache_namespace string vllm-mlx carries (None for an anonymous request)."""
        if self.agent is None:
            return None
        out = self.agent if self.fork_from is None else f"{self.agent}{FORK_SEPARATOR}{self.fork_from}"
        return out if self.edit is None else f"{out}{EDIT_SEPARATOR}{self.edit}"

    @classmethod
    def parse(cls, namespace: Any) -> "Route":
        """The route a cache_namespace encodes (a Route is returned as it is). A plain string without
        separators is an agent id (what a client's prompt_cache_key gives when no plugin answers)."""
        if isinstance(namespace, Route):
            return namespace
        if not namespace:
            return cls()
        text, edit = str(namespace), None
        if EDIT_SEPARATOR in text:
            text, _, edit = text.rpartition(EDIT_SEPARATOR)
        agent, _, parent = text.partition(FORK_SEPARATOR)
        return cls(agent, parent or None, edit)


def spliced_seed(agent: str, generation: int) -> str:
    """The chain seed of the agent's spliced histories of `generation` (rotations per token, at most)."""
    return f"{agent}{SPLICED_SEPARATOR}{generation}"


def legacy_spliced(namespace: str) -> Optional[tuple[str, int]]:
    """(agent, generation) of a manifest namespace written before the agent record (a spliced history
    stored as an agent of its own), else None. Migration only."""
    agent, sep, gen = namespace.rpartition(SPLICED_SEPARATOR)
    return (agent, int(gen)) if sep and gen.isdigit() and AGENT_ID_RE.fullmatch(agent) else None
