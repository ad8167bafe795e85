"""Authentication of the fleet's values in Redis: the shared secret, and the tags binding a value to
its key (docs/fleet.md, Authentication). Pure but for reading the secret's file; any thread."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from typing import Any, Mapping, Optional, Sequence, Union

logger = logging.getLogger("vllm_mlx_persist.fleet")

# The fleet's shared secret, from this environment variable or a file (backend option
# remote_secret_file), never from the command line. Shorter secrets are refused.
SECRET_ENV = "VLLM_MLX_PERSIST_FLEET_SECRET"
MIN_SECRET_BYTES = 16

TAG_KINDS = ("sha256", "hmac-sha256")  # a manifest's tag: unkeyed without a secret, HMAC with one
_MAC_MAGIC = b"vmp-hmac"  # an authenticated block value ends with this and its 32-byte HMAC
_MAC_TRAILER = len(_MAC_MAGIC) + 32


def load_secret(secret_file: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The fleet's shared secret: the content of `secret_file`, or the environment variable
    SECRET_ENV, surrounding whitespace stripped; None when neither is set. ValueError when both are
    set, the file cannot be read, or the secret is shorter than MIN_SECRET_BYTES."""
    env = os.environ if environ is None else environ
    from_env = env.get(SECRET_ENV)
    if secret_file is not None and from_env is not None:
        raise ValueError(f"persist_q4: the fleet secret is set twice (remote_secret_file and {SECRET_ENV}); set one")
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read(1 << 16).strip()
        except OSError as e:
            raise ValueError(f"persist_q4: cannot read remote_secret_file: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("fleet: remote_secret_file %s is open to other users (mode %o); chmod 600 it",
                           secret_file, stat.S_IMODE(mode))
        where = "remote_secret_file"
    elif from_env is not None:
        secret, where = from_env.strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"persist_q4: the fleet secret ({where}) has {len(secret)} bytes; at least "
                         f"{MIN_SECRET_BYTES} are needed (e.g. openssl rand -hex 32)")
    return secret


class Tagger:
    """Tags binding a value to its Redis key: HMAC-SHA256 under a key derived from the fleet's
    secret, or without a secret plain sha256 (catches damage, but anyone can recompute it)."""

    def __init__(self, secret: Optional[bytes]):
        self.kind = "hmac-sha256" if secret else "sha256"
        self._key = hmac.digest(secret, b"vllm-mlx-persist fleet mac 1", "sha256") if secret else None
        # Names the keyspace: servers with different secrets never read each other's values.
        self.key_id = hmac.digest(secret, b"vllm-mlx-persist fleet key id 1", "sha256").hex()[:16] if secret else None

    @property
    def authenticated(self) -> bool:
        """Whether values carry an HMAC under the fleet's secret (else a tag anyone can recompute)."""
        return self._key is not None

    def digest(self, domain: bytes, key: str, parts: Sequence[Union[bytes, memoryview]]) -> bytes:
        h = hmac.new(self._key, digestmod="sha256") if self._key is not None else hashlib.sha256()
        for part in (domain, key.encode(), *parts):  # length-prefixed: no two splits hash alike
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def tag(self, domain: bytes, key: str, parts: Sequence[bytes]) -> bytes:
        return self.kind.encode() + b":" + self.digest(domain, key, parts).hex().encode()

    def check(self, tag: Optional[bytes], domain: bytes, key: str, parts: Sequence[bytes]) -> Optional[str]:
        """None if `tag` is this tier's tag of the value under `key`; else 'missing', 'wrong' (of
        another kind than ours, e.g. unauthenticated, or not matching) or 'unknown' (a kind this
        build does not know)."""
        if not tag:
            return "missing"
        kind, sep, _ = tag.partition(b":")
        if not sep or kind.decode("ascii", "replace") not in TAG_KINDS:
            return "unknown"
        return None if hmac.compare_digest(tag, self.tag(domain, key, parts)) else "wrong"

    def unwrap_block(self, key: str, raw: bytes) -> tuple[Any, Optional[str]]:
        """(the block file inside a value, None), or (None, why its MAC is refused)."""
        if not self.authenticated:
            return raw, None
        if len(raw) < _MAC_TRAILER or raw[-_MAC_TRAILER:-32] != _MAC_MAGIC:
            return None, "missing"
        data = memoryview(raw)[:-_MAC_TRAILER]  # no copy: the block's arrays are views of it
        if not hmac.compare_digest(raw[-32:], self.digest(b"block", key, [data])):
            return None, "wrong"
        return data, None

    def wrap_block(self, key: str, raw: bytes) -> bytes:
        """The value stored for a block file: the file, and with a secret its MAC bound to the key."""
        if not self.authenticated:
            return raw
        return b"".join((raw, _MAC_MAGIC, self.digest(b"block", key, [raw])))
