"""The cache's file format: block files, agent manifests, model.json and the directory layout.

Owns what the bytes mean (docs/disk-format.md): the version and format names, the size caps, block
id and directory-name rules, the block and manifest records, and pure encode/decode functions that
check everything a reader must refuse. No I/O and no MLX: the disk tier (`store.py`) reads and
writes these bytes, the fleet tier (`fleet/`) puts the same block bytes and manifest fields in
Redis, and the offline tools name model directories with the same rules. Stateless, so any thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .record_settings import check_settings_at

FORMAT_VERSION = 1
# Manifests that hold an agent record's newer fields (spliced branches, removal records, the fork
# permission, no branch left) are written as version 2, so a build from before the agent record
# refuses them (it would serve a spliced branch to exact requests); every other manifest is written
# exactly as version 1. Readers accept both. Blocks and model.json stay version 1 (FORMAT_VERSION is
# part of the model fingerprint: changing it would start every cache afresh).
MANIFEST_VERSION = 2
MANIFEST_VERSIONS = (1, 2)

MODEL_FORMAT = "vllm-mlx-persist.model"
BLOCK_FORMAT = "vllm-mlx-persist.block"
MANIFEST_FORMAT = "vllm-mlx-persist.manifest"

# Layout of one model directory, <root>/<fingerprint[:32]>/.
MODEL_JSON = "model.json"
BLOCKS_DIR, AGENTS_DIR, QUARANTINE_DIR, TMP_DIR = "blocks", "agents", "quarantine", "tmp"
BLOCK_SUFFIX = ".safetensors"
MANIFEST_SUFFIX = ".json"

# Size caps a reader checks before it reads a file: anything larger is refused unread.
# A real block is a few MiB to tens of MiB (64 layers x 8 heads x 256 tokens x head_dim 128 is 18 MiB).
MAX_BLOCK_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 16 << 20  # ~240k block ids
MAX_MODEL_JSON_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20  # a block file's JSON header
MAX_ERA_CHARS = 128  # a manifest's era: the fleet tier's tombstone id (16 hex digits as written)
# a record's optional fields (version 2)
RECORD_FIELDS = ("removals", "spliced_cleared", "forkable", "settings_at", "removed_floor")
MAX_REMOVALS = 32  # removal records a manifest keeps (the newest; chain.Removal)

BLOCK_ID_RE = re.compile(r"[0-9a-f]{2,128}")
DIR_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
MODEL_DIR_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{31}")  # fingerprint[:32]

_TOKENS = "tokens"  # the block file's token-id tensor (a name no array may take)
# numpy dtype <-> safetensors dtype code (little-endian only)
_NP_TO_ST = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype("<u2"): "U16", np.dtype("<i2"): "I16", np.dtype("<f2"): "F16",
    np.dtype("<u4"): "U32", np.dtype("<i4"): "I32", np.dtype("<f4"): "F32",
    np.dtype("<u8"): "U64", np.dtype("<i8"): "I64", np.dtype("<f8"): "F64",
}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}


class FormatError(ValueError):
    """Bytes that are not a valid block, manifest or model.json of this format version."""


@dataclass
class BlockData:
    block_id: str
    tokens: np.ndarray  # int32 (n,)
    arrays: dict[str, np.ndarray]  # 16-bit floats arrive as uint16 views; real dtype in `dtypes`
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(a.nbytes for a in self.arrays.values())


@dataclass
class Manifest:
    namespace: str
    block_ids: list[str]
    n_tokens: int
    updated_at: float
    pinned: bool = False  # exempt from hot-tier eviction, the disk budget and the TTL
    # The agent's branches, least recently used first, when it has more than one plain chain:
    # [{"block_ids": [...], "n_tokens": n, "links": [[block index, namespace], ...], "last_used": t}]
    # (last_used optional: absent, the manifest's updated_at; chain.branches_of). None: one
    # branch, `block_ids` itself, seeded with the namespace. `block_ids` always lists every block
    # the manifest names (what the disk budget, GC and erasure count).
    branches: Optional[list] = None
    # The erasure the agent's history follows (docs/fleet.md, Erasure): the id of the fleet tier's
    # tombstone it was started on; None: it never met one. Optional, like `pinned` and `branches`.
    era: Optional[str] = None
    # Version 2 fields (MANIFEST_VERSION), all optional. Branch entries may carry "generation" (a
    # spliced history's, >= 1). `removals`: content forget edits removed, which a merge with another
    # server's copy must not bring back: [{"block", "index", "prev", "tail", "at"}] (chain.Removal).
    # `spliced_cleared`: spliced branches used at or before it are removed too. `forkable`: whether
    # other agents may fork this one (None: the server's fork_policy decides).
    removals: Optional[list] = None
    spliced_cleared: Optional[float] = None
    forkable: Optional[bool] = None
    # When each setting was last set ({"forkable": t}): which copy's setting wins (record_settings.py).
    settings_at: Optional[dict] = None
    # Removal records compacted away (MAX_REMOVALS) raised it: another copy's branches written at or
    # before it that this record does not hold are removed (chain.bound_removals).
    removed_floor: Optional[float] = None

    @property
    def record_fields(self) -> bool:
        """Whether the manifest holds anything only a version-2 reader understands."""
        return (self.removals is not None or self.spliced_cleared is not None or self.forkable is not None
                or self.settings_at is not None or self.removed_floor is not None
                or self.branches == [] or any(br.get("generation", 0) for br in self.branches or ()))


# ---------------------------------------------------------------------------------------------
# Names


def canonical_json(obj: Any) -> bytes:
    """The canonical JSON bytes checksums and tags are computed over (sorted keys, no spaces, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def check_block_id(block_id: str) -> str:
    """`block_id` if it is 2 to 128 lowercase hex digits (so it can never become another path), else ValueError."""
    if not isinstance(block_id, str) or not BLOCK_ID_RE.fullmatch(block_id):
        raise ValueError(f"block id must be 2 to 128 lowercase hex digits, got {block_id!r:.80}")
    return block_id


def block_relpath(block_id: str) -> str:
    """A block file's path below blocks/: `<id[:2]>/<id>.safetensors`."""
    check_block_id(block_id)
    return f"{block_id[:2]}/{block_id}{BLOCK_SUFFIX}"


def agent_key(namespace: str) -> str:
    """File-name key of an agent: sha256 of the namespace, hex (ids never become paths)."""
    if not isinstance(namespace, str):
        raise TypeError("namespace must be a str")
    return hashlib.sha256(namespace.encode("utf-8")).hexdigest()


def manifest_name(namespace: str) -> str:
    """An agent's manifest file name below agents/."""
    return f"{agent_key(namespace)}{MANIFEST_SUFFIX}"


# ---------------------------------------------------------------------------------------------
# model.json


def encode_model_json(fingerprint: str, model_info: dict, format_info: dict, created_at: float) -> bytes:
    """The bytes of a new model directory's model.json."""
    info = {"format": MODEL_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fingerprint,
            "model_info": model_info, "format_info": format_info, "created_at": created_at}
    return json.dumps(info, sort_keys=True, indent=1, default=str).encode()


def decode_model_json(raw: bytes) -> dict:
    """model.json as a dict holding at least `fingerprint` and `format_version` (not compared here);
    FormatError when it is not that."""
    try:
        info = json.loads(raw)
        info["fingerprint"], info["format_version"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise FormatError(str(e)) from None
    return info


# ---------------------------------------------------------------------------------------------
# Block files: safetensors, with the block's id, token count, dtypes and checksum in __metadata__


def _prepare_array(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype not in _NP_TO_ST:
        raise ValueError(f"array {name!r}: dtype {a.dtype} cannot be stored (view 16-bit floats as uint16)")
    return np.ascontiguousarray(a)


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def block_sha256(block_id: str, n_tokens: int, dtypes: dict[str, str],
                 tensors: list[tuple[str, str, list[int], memoryview]]) -> str:
    """sha256 over a canonical descriptor (id, n_tokens, dtypes, names/dtypes/shapes) then the data
    of every tensor in name order: covers tokens, arrays and everything the header says about them.
    What blocks written before the crc32 check carry; read, no longer written."""
    h = hashlib.sha256()
    desc = {"block_id": block_id, "n_tokens": n_tokens, "dtypes": dtypes,
            "tensors": [[n, d, s] for n, d, s, _ in tensors]}
    h.update(canonical_json(desc))
    for _, _, _, data in tensors:
        h.update(data)
    return "sha256:" + h.hexdigest()


def block_crc32(block_id: str, n_tokens: int, dtypes: dict[str, str],
                tensors: list[tuple[str, str, list[int], tuple[int, int]]], data: list[memoryview]) -> str:
    """crc32 over a canonical descriptor (id, n_tokens, dtypes, names/dtypes/shapes/data offsets)
    then the data section as laid out in the file: one pass over contiguous bytes, 2.4x sha256's
    speed on the bench CPU, and zlib releases the GIL for it, so parallel readers verify in parallel."""
    desc = {"block_id": block_id, "n_tokens": n_tokens, "dtypes": dtypes,
            "tensors": [[n, d, s, list(o)] for n, d, s, o in tensors]}
    crc = zlib.crc32(canonical_json(desc))
    for chunk in data:
        crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def block_chunks(block: BlockData) -> tuple[list[memoryview], str, int]:
    """A block file as (chunks, checksum, total size), straight from the arrays' buffers (no copy);
    ValueError for a block that cannot be stored."""
    block_id = check_block_id(block.block_id)
    tokens = _prepare_array(_TOKENS, block.tokens)
    if tokens.dtype != np.int32 or tokens.ndim != 1:
        raise ValueError(f"block {block_id}: tokens must be 1-D int32, got {tokens.dtype} {tokens.shape}")
    if _TOKENS in block.arrays:
        raise ValueError(f"block {block_id}: array name {_TOKENS!r} is reserved")
    unknown = set(block.dtypes) - set(block.arrays)
    if unknown:
        raise ValueError(f"block {block_id}: dtypes names arrays it does not have: {sorted(unknown)}")
    arrays = {n: _prepare_array(n, a) for n, a in block.arrays.items()}
    arrays[_TOKENS] = tokens
    dtypes = {str(k): str(v) for k, v in block.dtypes.items()}
    n_tokens = int(tokens.shape[0])

    views = {n: _bytes_view(a) for n, a in arrays.items()}
    # Data section: larger item sizes first so every tensor stays aligned to its item size.
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": {
        "format": BLOCK_FORMAT, "format_version": str(FORMAT_VERSION), "block_id": block_id,
        "n_tokens": str(n_tokens), "dtypes": json.dumps(dtypes, sort_keys=True)}}
    off = 0
    for n in order:
        size = len(views[n])
        header[n] = {"dtype": _NP_TO_ST[arrays[n].dtype], "shape": list(arrays[n].shape),
                     "data_offsets": [off, off + size]}
        off += size
    tensors = [(n, header[n]["dtype"], header[n]["shape"], tuple(header[n]["data_offsets"])) for n in sorted(arrays)]
    checksum = block_crc32(block_id, n_tokens, dtypes, tensors, [views[n] for n in order])
    header["__metadata__"]["checksum"] = checksum
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-(8 + len(hbytes)) % 8)  # data starts 8-byte aligned
    chunks = [memoryview(len(hbytes).to_bytes(8, "little")), memoryview(hbytes)] + [views[n] for n in order]
    return chunks, checksum, 8 + len(hbytes) + off


def encode_block(block: BlockData) -> bytes:
    """The exact bytes of a block's file (and of its value in the fleet tier)."""
    return b"".join(block_chunks(block)[0])


def header_length(first8: bytes, size: int) -> int:
    """The header length a block file's first 8 bytes give; FormatError unless it fits a `size`-byte file."""
    if size < 8:
        raise FormatError(f"truncated: {size} bytes")
    hlen = int.from_bytes(first8[:8], "little")
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise FormatError(f"header length {hlen} does not fit a {size}-byte file")
    return hlen


def block_metadata(header: bytes) -> dict:
    """A block header's `__metadata__` (unverified: format, format_version, block_id, checksum...)
    from the header's JSON bytes; FormatError when it does not parse."""
    try:
        meta = json.loads(bytes(header))["__metadata__"]
        if not isinstance(meta, dict):
            raise TypeError("__metadata__ is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise FormatError(f"bad header: {e}") from None
    return meta


def described_size(hlen: int, header: bytes) -> int:
    """The file size a block header of `hlen` bytes describes (header, then its tensors' data), read
    from the header alone: an oversized or padded file is refused before its data is read."""
    try:
        tensors = json.loads(bytes(header))
        data_len = max((int(t["data_offsets"][1]) for n, t in tensors.items() if n != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        raise FormatError(f"bad header: {type(e).__name__}: {e}"[:300]) from None
    return 8 + hlen + data_len


def decode_block(buf: bytes | bytearray, block_id: str) -> BlockData:
    """Parse and fully verify a block file's bytes; FormatError unless they are a valid block
    `block_id` of this format version. Arrays are views of `buf` (read-only when it is bytes)."""
    size = len(buf)
    hlen = header_length(buf[:8], size)
    try:
        header = json.loads(bytes(buf[8:8 + hlen]))
        meta = header.pop("__metadata__")
        if not isinstance(meta, dict):
            raise TypeError("__metadata__ is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise FormatError(f"bad header: {e}") from None
    if meta.get("format") != BLOCK_FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
        raise FormatError(f"format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                          f"expected {BLOCK_FORMAT!r} version {FORMAT_VERSION}")
    if meta.get("block_id") != block_id:
        raise FormatError(f"file holds block {str(meta.get('block_id'))[:80]!r}, not {block_id!r}")
    try:
        n_tokens = int(meta["n_tokens"])
        dtypes = json.loads(meta["dtypes"])
        checksum = meta["checksum"]
        if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
            raise TypeError("dtypes is not a name -> str map")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise FormatError(f"bad metadata: {e}") from None

    data_start = 8 + hlen
    data_len = size - data_start
    base = memoryview(buf)[data_start:]
    spans, tensors, arrays = [], [], {}  # tensors: (name, dtype, shape, data view, offsets)
    for name in sorted(header):
        t = header[name]
        try:
            dt = _ST_TO_NP[t["dtype"]]
            shape = [int(s) for s in t["shape"]]
            begin, end = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"tensor {name!r}: bad entry ({e})") from None
        if any(s < 0 for s in shape) or not 0 <= begin <= end <= data_len:
            raise FormatError(f"tensor {name!r}: offsets {begin}..{end} outside the {data_len}-byte data")
        if end - begin != math.prod(shape) * dt.itemsize:
            raise FormatError(f"tensor {name!r}: {end - begin} bytes for shape {shape} {dt}")
        spans.append((begin, end))
        view = base[begin:end]
        tensors.append((name, t["dtype"], shape, view, (begin, end)))
        arrays[name] = np.frombuffer(view, dtype=dt).reshape(shape) if end > begin else np.zeros(shape, dt)
    # The data section must be covered exactly, without holes or overlaps (as safetensors requires).
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise FormatError("tensor data has holes or overlaps")
        pos = end
    if pos != data_len:
        raise FormatError(f"data section is {data_len} bytes, tensors cover {pos}")
    if not isinstance(checksum, str) or not checksum.startswith(("crc32:", "sha256:")):
        raise FormatError(f"unknown checksum {str(checksum)[:40]!r}")
    if checksum.startswith("crc32:"):
        computed = block_crc32(block_id, n_tokens, dtypes, [(n, d, s, o) for n, d, s, _, o in tensors], [base])
    else:  # written by an earlier build
        computed = block_sha256(block_id, n_tokens, dtypes, [(n, d, s, v) for n, d, s, v, _ in tensors])
    if computed != checksum:
        raise FormatError("checksum mismatch")
    tokens = arrays.pop(_TOKENS, None)
    if tokens is None or tokens.dtype != np.int32 or tokens.shape != (n_tokens,):
        raise FormatError("missing or malformed tokens")
    if set(dtypes) - set(arrays):
        raise FormatError("dtypes names missing arrays")
    return BlockData(block_id=block_id, tokens=tokens, arrays=arrays, dtypes=dtypes)


# ---------------------------------------------------------------------------------------------
# Manifests: one JSON object per agent, checksummed


def check_era(era: Any) -> None:
    """Raise ValueError unless `era` is a tombstone id as a manifest may carry it."""
    if not isinstance(era, str) or not 0 < len(era) <= MAX_ERA_CHARS or not era.isascii() or not era.isprintable():
        raise ValueError("malformed manifest era")


def check_branches(branches: Any, named: set, allow_empty: bool = False) -> None:
    """Raise ValueError unless `branches` is a well-formed list of branches over `named` blocks
    (`allow_empty`: a version-2 record may have none left, its removal records being what it holds)."""
    if not isinstance(branches, list) or not (branches or allow_empty):
        raise ValueError("manifest branches must be a non-empty list")
    for br in branches:
        ids, n, links = (br.get("block_ids"), br.get("n_tokens"), br.get("links")) if isinstance(br, dict) else (None,) * 3
        if (not isinstance(ids, list) or not all(isinstance(b, str) and b in named for b in ids)
                or not isinstance(n, int) or n < 0 or not isinstance(links, list) or not links
                or not all(isinstance(l, list) and len(l) == 2 and isinstance(l[0], int) and isinstance(l[1], str)
                           for l in links)
                or links[0][0] != 0 or [l[0] for l in links] != sorted({l[0] for l in links})):
            raise ValueError("malformed manifest branch")
        used = br.get("last_used", 0.0)  # optional: absent in manifests written before it existed
        if isinstance(used, bool) or not isinstance(used, (int, float)) or not math.isfinite(used):
            raise ValueError("malformed manifest branch: last_used")
        rotations = br.get("rotations", [])  # optional: spliced histories only (kv_edit/rotations.py)
        if not isinstance(rotations, list) or not all(
                isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r) and 0 <= r[0] < r[1] <= n
                and r[2] >= 1 for r in rotations) or any(a[1] > b[0] for a, b in zip(rotations, rotations[1:])):
            raise ValueError("malformed manifest branch: rotations")
        made = br.get("made", 0.0)  # optional: when a commit last wrote it, when not its last use
        if isinstance(made, bool) or not isinstance(made, (int, float)) or not math.isfinite(made):
            raise ValueError("malformed manifest branch: made")
        generation = br.get("generation", 0)  # optional (version 2): a spliced history's
        if type(generation) is not int or generation < 0:
            raise ValueError("malformed manifest branch: generation")


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def check_removals(removals: Any) -> None:
    """Raise ValueError unless `removals` is a well-formed list of removal records (chain.Removal)."""
    if not isinstance(removals, list) or len(removals) > MAX_REMOVALS:
        raise ValueError("manifest removals must be a list of at most %d records" % MAX_REMOVALS)
    for r in removals:
        if (not isinstance(r, dict) or not isinstance(r.get("block"), str) or not BLOCK_ID_RE.fullmatch(r["block"])
                or type(r.get("index")) is not int or r["index"] < 0 or not _finite(r.get("at"))
                or not (r.get("prev") is None or (isinstance(r["prev"], str) and BLOCK_ID_RE.fullmatch(r["prev"])))
                or not isinstance(r.get("tail", []), list) or not all(type(t) is int for t in r.get("tail", []))):
            raise ValueError("malformed manifest removal record")


def _check_record(m: Manifest) -> None:
    """Raise ValueError unless the version-2 fields of `m` are well formed."""
    if m.removals is not None:
        check_removals(m.removals)
    if m.spliced_cleared is not None and not _finite(m.spliced_cleared):
        raise ValueError("malformed manifest spliced_cleared")
    if m.forkable is not None and not isinstance(m.forkable, bool):
        raise ValueError("malformed manifest forkable")
    if m.settings_at is not None:
        check_settings_at(m.settings_at)
    if m.removed_floor is not None and not _finite(m.removed_floor):
        raise ValueError("malformed manifest removed_floor")


def encode_manifest(m: Manifest) -> bytes:
    """A manifest file's bytes; ValueError for a manifest that is not well formed."""
    if not isinstance(m.namespace, str) or not m.namespace:
        raise ValueError("manifest namespace must be a non-empty string")
    for b in m.block_ids:
        check_block_id(b)
    v2 = m.record_fields
    body = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION if v2 else 1, "namespace": m.namespace,
            "block_ids": list(m.block_ids), "n_tokens": int(m.n_tokens), "updated_at": float(m.updated_at)}
    if m.pinned:  # optional field: manifests of unpinned agents read the same as before
        body["pinned"] = True
    if m.branches is not None:  # optional too: agents that never branch or fork read as before
        check_branches(m.branches, set(m.block_ids), allow_empty=v2)
        body["branches"] = m.branches
    if m.era is not None:  # optional too: absent for every history that never met an erasure
        check_era(m.era)
        body["era"] = m.era
    _check_record(m)
    for name in RECORD_FIELDS:  # version 2, each optional
        if getattr(m, name) is not None:
            body[name] = getattr(m, name)
    body["checksum"] = "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()
    return json.dumps(body, sort_keys=True, ensure_ascii=True).encode()


def decode_manifest(raw: bytes) -> Manifest:
    """Parse and fully verify a manifest file's bytes; FormatError when they are not a valid manifest."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("not an object")
        checksum = body.pop("checksum")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise FormatError(f"bad manifest: {e}") from None
    version = body.get("format_version")
    if body.get("format") != MANIFEST_FORMAT or type(version) is not int or version not in MANIFEST_VERSIONS:
        raise FormatError(f"manifest format {body.get('format')!r} version {body.get('format_version')!r}")
    if checksum != "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest():
        raise FormatError("checksum mismatch")
    ns, ids, n, ts = body.get("namespace"), body.get("block_ids"), body.get("n_tokens"), body.get("updated_at")
    pinned = body.get("pinned", False)
    if (not isinstance(ns, str) or not isinstance(ids, list) or not isinstance(n, int)
            or not isinstance(ts, (int, float)) or not isinstance(pinned, bool)
            or not all(isinstance(b, str) and BLOCK_ID_RE.fullmatch(b) for b in ids)):
        raise FormatError("malformed manifest fields")
    branches = body.get("branches")
    era = body.get("era")
    record = {k: body.get(k) for k in RECORD_FIELDS} if version >= 2 else {}
    m = Manifest(namespace=ns, block_ids=list(ids), n_tokens=n, updated_at=float(ts), pinned=pinned,
                 branches=branches, era=era, **record)
    try:
        if branches is not None:
            check_branches(branches, set(ids), allow_empty=version >= 2)
        if era is not None:
            check_era(era)
        _check_record(m)
        if m.record_fields and version < 2:  # a version-1 manifest cannot hold spliced branches
            raise ValueError("a version-2 field in a version-1 manifest")
    except ValueError as e:
        raise FormatError(str(e)) from None
    return m


def lenient_block_ids(raw: bytes) -> set[str]:
    """The block ids a manifest's bytes name, read without its checks (any format version: what an
    erasure of a directory this build cannot serve goes by); empty when they do not parse."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return set()
    ids = body.get("block_ids") if isinstance(body, dict) else None
    return {b for b in ids if isinstance(b, str) and BLOCK_ID_RE.fullmatch(b)} if isinstance(ids, list) else set()
