"""The cache namespace of a request: what an agent id may be, and what rides with it.

Owns the one encoding the plugin's namespace hook writes and the backend reads. An agent id is 1 to
128 characters from `[A-Za-z0-9._:@-]`, starting with a letter or digit, so never NUL: everything
else rides after a NUL-led separator, `agent[\\0fork:parent][\\0edit:mode]` (a fork's parent, a span
directive's mode: kv_edit/request.py). vllm-mlx carries the string opaquely (the seam's `cache_namespace`).
The pool stores an agent's spliced histories under `agent\\0amortized:g`, a namespace no request
can name. Pure and stateless (no MLX, no vllm-mlx): the plugin, the backend, the pool, the admin
API and the scenario tool import it from any thread.
"""

from __future__ import annotations

import re
from typing import Any, Optional

MAX_AGENT_ID_LEN = 128
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
FORK_SEPARATOR = "\0fork:"
EDIT_SEPARATOR = "\0edit:"
AMORTIZED_SEPARATOR = "\0amortized:"


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


def join_namespace(agent_id: str, parent: Optional[str] = None, mode: Optional[str] = None) -> str:
    """The cache_namespace of a request by `agent_id`, forking from `parent` and declaring the edit
    `mode` (None: no fork, no mode; then it is the agent id itself)."""
    namespace = agent_id if parent is None else f"{agent_id}{FORK_SEPARATOR}{parent}"
    return namespace if mode is None else f"{namespace}{EDIT_SEPARATOR}{mode}"


def split_namespace(namespace: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(agent, fork parent or None) from a request's cache_namespace; the edit mode is `edit_mode`'s."""
    if namespace is not None and EDIT_SEPARATOR in namespace:
        namespace = namespace.rpartition(EDIT_SEPARATOR)[0]
    if namespace is None or FORK_SEPARATOR not in namespace:
        return namespace, None
    agent, _, parent = namespace.partition(FORK_SEPARATOR)
    return agent, parent


def edit_mode(namespace: Optional[str]) -> Optional[str]:
    """The span-directive mode a request's cache_namespace carries (None: exact). Only the plugin
    writes one, after checking it against kv_edit.MODES."""
    if namespace is None or EDIT_SEPARATOR not in namespace:
        return None
    return namespace.rpartition(EDIT_SEPARATOR)[2]


def amortized_namespace(agent: str, generation: int) -> str:
    """Where an agent's spliced histories of `generation` (rotations per token, at most) are stored."""
    return f"{agent}{AMORTIZED_SEPARATOR}{generation}"


def amortized_of(namespace: str) -> Optional[tuple[str, int]]:
    """(agent, generation) of an amortized namespace, else None."""
    agent, sep, gen = namespace.rpartition(AMORTIZED_SEPARATOR)
    return (agent, int(gen)) if sep and gen.isdigit() else None
