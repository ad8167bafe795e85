"""The fleet tier's settings, one typed value: where Redis is and how it is reached, the tier's bounds
and TTLs, and the sync side's. Built from the backend's options in one place (`from_options`); tests
and tools build their own. Pure; checked when built, so a `FleetSettings` is always a usable one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from .auth import MIN_SECRET_BYTES, load_secret


@dataclass(frozen=True)
class FleetSettings:
    """`RemoteTier`'s (url to max_erasures) and `Fleet`'s (wait_s to max_fetch_bytes) settings."""

    url: str  # redis://[user:password@]host:port/db, rediss://... (TLS), unix:///path.sock
    cluster: bool = False  # `url` is a node of a Redis Cluster (its client discovers the rest)
    # The fleet's shared secret (auth.load_secret): every value in Redis carries an HMAC under it.
    secret: Union[bytes, str, None] = field(default=None, repr=False)
    key_prefix: str = "vmp"
    # Redis I/O: every socket operation bounded, one attempt per command.
    read_timeout_s: float = 2.0
    connect_timeout_s: float = 0.5
    write_timeout_s: float = 10.0
    read_threads: int = 2
    fetch_blocks: int = 16  # blocks asked for in one pipelined round trip, at most
    fetch_bytes: int = 16 << 20  # and about this many bytes
    # The writer: its queue's bounds, retries with back-off, the breaker.
    queue_max: int = 256
    queue_max_bytes: int = 1 << 30
    max_attempts: int = 4
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    # TTLs in Redis (0: none). A tombstone must outlive every manifest it may have replaced, or a
    # server still holding that history could publish it again once the tombstone is gone
    # (docs/fleet.md, Erasure): by default it lives as long as manifests.
    block_ttl_s: int = 7 * 86400
    manifest_ttl_s: int = 30 * 86400
    tombstone_ttl_s: Optional[int] = None
    # This server's view of agents in Redis: how many it remembers; removals and settings (erasures,
    # forgets' and settings' publishes) pending in the outbox at once (more are refused: HTTP 503), and
    # how often the outbox is sent again while the server runs.
    max_agents: int = 100_000
    max_erasures: int = 10_000
    outbox_retry_s: float = 10.0
    # The sync side (fleet.sync.Fleet): how long a request waits for its agent's sync, how long a
    # sync waits for the local save of what it fetched, its threads, the syncs tracked at once, and
    # the block data one sync holds (None: the local write queue's byte budget).
    wait_s: float = 3.0
    save_timeout_s: float = 30.0
    sync_threads: int = 2
    max_syncs: int = 1024
    max_fetch_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.tombstone_ttl_s is None:
            object.__setattr__(self, "tombstone_ttl_s", self.manifest_ttl_s)
        manifest_ttl_s, tombstone_ttl_s = self.manifest_ttl_s, self.tombstone_ttl_s
        if manifest_ttl_s > 0 and 0 < tombstone_ttl_s < manifest_ttl_s or manifest_ttl_s <= 0 < tombstone_ttl_s:
            raise ValueError("tombstone_ttl_s must be at least manifest_ttl_s (0: no TTL for either)")
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode())
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the fleet secret must have at least {MIN_SECRET_BYTES} bytes")
        if min(self.queue_max, self.read_threads, self.max_attempts, self.fetch_blocks, self.fetch_bytes,
               self.max_erasures) < 1:
            raise ValueError("queue_max, read_threads, max_attempts, fetch_blocks, fetch_bytes and max_erasures "
                             "must be at least 1")
        if not self.outbox_retry_s > 0:
            raise ValueError("outbox_retry_s must be positive")

    @classmethod
    def from_options(cls, opts: Mapping[str, Any]) -> "FleetSettings":
        """The settings of the backend's options (options.parse_options, with `remote_url` set): the
        Redis client must be installed, and the secret is read (its file, or SECRET_ENV). ValueError,
        naming what to do, when either fails."""
        try:
            import redis  # noqa: F401
        except ImportError:
            raise ValueError('persist_q4: remote_url is set but the Redis client is not installed: '
                             'pip install "vllm-mlx-persist[fleet]"') from None
        return cls(
            opts["remote_url"],
            cluster=opts["remote_cluster"],
            secret=load_secret(opts["remote_secret_file"]),
            read_timeout_s=opts["remote_timeout_s"],
            queue_max_bytes=int(opts["remote_queue_mb"] * 2**20),
            fetch_bytes=max(1, int(opts["remote_fetch_mb"] * 2**20)),
            block_ttl_s=int(opts["remote_block_ttl_hours"] * 3600),
            manifest_ttl_s=int(opts["remote_manifest_ttl_hours"] * 3600),
            wait_s=opts["remote_wait_s"],
            save_timeout_s=opts["write_timeout_s"],
        )
