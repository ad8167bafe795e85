"""Where the fleet's values live in Redis, and the version of what they are: every key of one model,
in the keyspace of this build's REMOTE_FORMAT_VERSION (and of the secret's key id when there is one),
and the model record that claims that keyspace (docs/fleet.md, "What is in Redis", Versions). Pure."""

from __future__ import annotations

from ..disk_format import FORMAT_VERSION, agent_key, canonical_json, check_block_id
from .auth import Tagger

# The version of everything this tier writes to Redis: key layout, block values, manifest fields and
# body, tags. It names the keyspace (vmp:<fingerprint[:32]>:r3:...), and a build reads and writes
# only its own, so builds of different versions sharing one Redis never see each other's values.
# Rule (docs/fleet.md, "Versions"): a build may write into keyspace rN only what every build that
# reads rN accepts; any change an older reader of rN would refuse (a new block checksum kind or
# disk_format.FORMAT_VERSION, a manifest field it cannot ignore, another tag or MAC layout) bumps it.
# r3: a manifest is the agent's whole record, with spliced branches ("generation") and removal records
# an r2 reader would ignore (serving spliced K/V as honest, merging removed branches back).
REMOTE_FORMAT_VERSION = 3
# The block checksum kinds every r3 reader verifies (disk_format.decode_block): the only ones r3 may hold.
BLOCK_CHECKSUM_KINDS = ("crc32", "sha256")

_MODEL_FORMAT = "vllm-mlx-persist.remote-model"


def agent_key_of(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("agent id (namespace) must be a non-empty string")
    return agent_key(namespace)


class Keyspace:
    """The keys of one model's values (`prefix`), and its model record (`model`: the key;
    `model_value`: the record, tagged as `tagger` tags)."""

    def __init__(self, key_prefix: str, fingerprint: str, tagger: Tagger):
        self.prefix = (f"{key_prefix}:{fingerprint[:32]}:r{REMOTE_FORMAT_VERSION}:"
                       + (f"k{tagger.key_id}:" if tagger.key_id else ""))
        self.model = self.prefix + "model"
        model = {"format": _MODEL_FORMAT, "remote_version": REMOTE_FORMAT_VERSION, "format_version": FORMAT_VERSION,
                 "fingerprint": fingerprint, "auth": tagger.kind}
        model["tag"] = tagger.tag(b"model", self.model, [canonical_json(model)]).decode()
        self.model_value = canonical_json(model)

    def block(self, block_id: str) -> str:
        return self.prefix + "b:" + check_block_id(block_id)

    def manifest(self, namespace: str) -> str:
        return self.prefix + "a:" + agent_key_of(namespace)
