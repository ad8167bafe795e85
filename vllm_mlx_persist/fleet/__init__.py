"""The fleet tier (docs/fleet.md): Redis below the local disk, shared by several servers. `tier`
(`RemoteTier`: the Redis side, composed of `auth`, `keyspace`, `connection`, `manifests`, `eras`,
`reads`, `writer` and `state`), `settings` (`FleetSettings`), `sync` (`Fleet`: when a server asks
Redis, what it fetches and publishes) and `pool_api` (`FleetPool`: what the fleet needs of the pool).
Importing it loads no Redis client (the tier does, when built) and no MLX."""

from .auth import SECRET_ENV, load_secret
from .manifests import RemoteManifest
from .pool_api import FleetPool
from .settings import FleetSettings
from .sync import Fleet
from .tier import RemoteTier

__all__ = ["SECRET_ENV", "Fleet", "FleetPool", "FleetSettings", "RemoteManifest", "RemoteTier", "load_secret"]
