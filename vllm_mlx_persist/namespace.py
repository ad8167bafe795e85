"""The cache namespace of a request: what an agent id may be, and how a fork's parent rides with it.

Owns the one encoding the plugin's namespace hook writes and the backend reads: an agent id is 1 to
128 characters from `[A-Za-z0-9._:@-]`, starting with a letter or digit (so never NUL), and a fork
is `"child\\0fork:parent"`. vllm-mlx carries the string opaquely (the seam's `cache_namespace`).
Pure and stateless (no MLX, no vllm-mlx): the plugin, the backend, the admin API and the scenario
tool import it from any thread.
"""

from __future__ import annotations

import re
from typing import Any, Optional

MAX_AGENT_ID_LEN = 128
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
FORK_SEPARATOR = "\0fork:"  # agent ids never contain NUL, so it cannot occur inside one


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


def join_namespace(agent_id: str, parent: Optional[str]) -> str:
    """The cache_namespace of a request by `agent_id`, forking from `parent` (None: no fork)."""
    return agent_id if parent is None else f"{agent_id}{FORK_SEPARATOR}{parent}"


def split_namespace(namespace: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(agent, fork parent or None) from a request's cache_namespace: join_namespace undone."""
    if namespace is None or FORK_SEPARATOR not in namespace:
        return namespace, None
    agent, _, parent = namespace.partition(FORK_SEPARATOR)
    return agent, parent
