"""Disk tier: real files in tmp_path, real failures (rlimit, SIGKILL) in subprocesses."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_mlx_persist import disk_format
from vllm_mlx_persist import quarantine as quarantine_mod
from vllm_mlx_persist import store as store_mod
from vllm_mlx_persist.cache_root import CacheDirLock
from vllm_mlx_persist.disk_format import FORMAT_VERSION, BlockData, Manifest, agent_key
from vllm_mlx_persist.store import DiskStore, ModelMismatchError, StoreError, StoreWriteError

REPO = Path(__file__).resolve().parents[1]
FP = "ab" * 32
MODEL_INFO = {"name": "tiny-test-model", "path": "/models/tiny"}
FORMAT_INFO = {"bits": 4, "group_size": 64, "block_size": 256}


def make_block(seed: int, n_tokens: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 64) -> BlockData:
    rng = np.random.default_rng(seed)
    arrays, dtypes = {}, {}
    for layer in range(layers):
        for kv in "kv":
            arrays[f"{layer}.{kv}.q"] = rng.integers(0, 2**32, size=(heads, n_tokens, head_dim // 8), dtype=np.uint32)
            # bfloat16 scales/biases travel as raw uint16 bits (includes NaN/inf patterns: must stay exact)
            arrays[f"{layer}.{kv}.s"] = rng.integers(0, 2**16, size=(heads, n_tokens, head_dim // 64), dtype=np.uint16)
            arrays[f"{layer}.{kv}.b"] = rng.integers(0, 2**16, size=(heads, n_tokens, head_dim // 64), dtype=np.uint16)
            dtypes[f"{layer}.{kv}.s"] = dtypes[f"{layer}.{kv}.b"] = "bfloat16"
    arrays["extra.f32"] = rng.standard_normal((3, 5)).astype(np.float32)
    tokens = rng.integers(0, 150_000, size=n_tokens, dtype=np.int32)
    block_id = hashlib.sha256(f"{seed}:{tokens.tobytes().hex()}".encode()).hexdigest()
    return BlockData(block_id=block_id, tokens=tokens, arrays=arrays, dtypes=dtypes)


def assert_same(a: BlockData, b: BlockData) -> None:
    assert a.block_id == b.block_id
    assert b.tokens.dtype == np.int32 and np.array_equal(a.tokens, b.tokens)
    assert a.dtypes == b.dtypes
    assert set(a.arrays) == set(b.arrays)
    for k in a.arrays:
        assert b.arrays[k].dtype == a.arrays[k].dtype, k
        assert b.arrays[k].shape == a.arrays[k].shape, k
        assert a.arrays[k].tobytes() == b.arrays[k].tobytes(), k


def open_store(root: Path, fp: str = FP) -> DiskStore:
    return DiskStore(root, fp, MODEL_INFO, FORMAT_INFO)


def quarantined(s: DiskStore) -> list[str]:
    return sorted(os.listdir(s.quarantine_dir))


def run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


# --- layout and round trips -----------------------------------------------------------------


def test_layout_and_model_json(tmp_path):
    s = open_store(tmp_path)
    assert s.dir == s.model_dir == tmp_path / FP[:32]
    for d in ("blocks", "agents", "quarantine", "tmp"):
        assert (s.dir / d).is_dir()
    info = json.loads((s.dir / "model.json").read_text())
    assert info["fingerprint"] == FP and info["format_version"] == FORMAT_VERSION == 1
    assert info["model_info"] == MODEL_INFO and info["format_info"] == FORMAT_INFO
    open_store(tmp_path)  # reopening the same model is fine


def test_block_round_trip_bit_exact(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(1)
    n = s.write_block(blk)
    path = s.dir / "blocks" / blk.block_id[:2] / f"{blk.block_id}.safetensors"
    assert n == path.stat().st_size > 0
    assert s.has_block(blk.block_id)
    got = s.read_block(blk.block_id)
    assert_same(blk, got)
    # a fresh store (restart) reads it too
    assert_same(blk, open_store(tmp_path).read_block(blk.block_id))
    assert os.listdir(s.tmp_dir) == []


def test_partial_tail_block_and_odd_shapes(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(2, n_tokens=7)  # tail block: fewer tokens than block_size
    blk.arrays["empty"] = np.zeros((0, 4), dtype=np.uint32)
    blk.arrays["odd16"] = np.arange(3, dtype=np.uint16)  # odd byte count before/after 4-byte tensors
    blk.arrays["f16"] = np.array([1.5, -0.0, np.inf], dtype=np.float16)
    blk.arrays["noncontig"] = np.arange(24, dtype=np.uint32).reshape(4, 6)[:, ::2]
    s.write_block(blk)
    got = s.read_block(blk.block_id)
    blk.arrays["noncontig"] = np.ascontiguousarray(blk.arrays["noncontig"])
    assert_same(blk, got)
    assert got.tokens.shape == (7,)


def test_block_file_is_standard_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    s = open_store(tmp_path)
    blk = make_block(3)
    s.write_block(blk)
    path = s.block_path(blk.block_id)
    loaded = load_file(str(path))
    assert np.array_equal(loaded["tokens"], blk.tokens)
    for k, v in blk.arrays.items():
        assert np.array_equal(loaded[k], v)
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["format_version"] == "1" and meta["block_id"] == blk.block_id
    assert int(meta["n_tokens"]) == len(blk.tokens)
    assert json.loads(meta["dtypes"]) == blk.dtypes
    assert meta["checksum"].startswith("crc32:")


def test_write_existing_block_is_skipped(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(4)
    assert s.write_block(blk) > 0
    mtime = s.block_path(blk.block_id).stat().st_mtime_ns
    assert s.write_block(blk) == 0
    assert s.block_path(blk.block_id).stat().st_mtime_ns == mtime


def test_write_replaces_truncated_existing_file(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(5)
    s.write_block(blk)
    p = s.block_path(blk.block_id)
    p.write_bytes(p.read_bytes()[:-10])
    assert s.write_block(blk) > 0
    assert_same(blk, s.read_block(blk.block_id))


def test_invalid_inputs_raise(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(6)
    with pytest.raises(ValueError):
        s.write_block(BlockData("../../etc/passwd", blk.tokens, blk.arrays, blk.dtypes))
    with pytest.raises(ValueError):
        s.read_block("../x")
    with pytest.raises(ValueError):
        s.write_block(BlockData(blk.block_id, blk.tokens.astype(np.int64), blk.arrays, blk.dtypes))
    with pytest.raises(ValueError):
        s.write_block(BlockData(blk.block_id, blk.tokens, {"tokens": blk.tokens}, {}))
    with pytest.raises(ValueError):
        s.write_block(BlockData(blk.block_id, blk.tokens, {"x": np.zeros(2, dtype=np.complex64)}, {}))
    with pytest.raises(ValueError):
        DiskStore(tmp_path, "short", MODEL_INFO, FORMAT_INFO)
    with pytest.raises(ValueError):
        DiskStore(tmp_path, "../" + "a" * 40, MODEL_INFO, FORMAT_INFO)


def test_manifest_round_trip(tmp_path):
    s = open_store(tmp_path)
    assert s.read_manifest("agent-1") is None
    m = Manifest("agent-1", ["aa" * 32, "bb" * 32, "cc" * 32], 600, time.time())
    s.write_manifest(m)
    assert s.read_manifest("agent-1") == m
    assert open_store(tmp_path).read_manifest("agent-1") == m
    m2 = Manifest("agent-1", ["aa" * 32], 10, m.updated_at + 1)
    s.write_manifest(m2)
    assert s.read_manifest("agent-1") == m2
    s.write_manifest(Manifest("agent-2", [], 0, 1.0))
    assert sorted(x.namespace for x in s.list_manifests()) == ["agent-1", "agent-2"]
    s.delete_manifest("agent-1")
    s.delete_manifest("agent-1")
    assert s.read_manifest("agent-1") is None
    assert [x.namespace for x in s.list_manifests()] == ["agent-2"]
    assert os.listdir(s.tmp_dir) == []


def test_a_branchs_last_use_is_an_optional_field(tmp_path):
    """`last_used` per branch (docs/disk-format.md): written and read back; a manifest without it (an
    older writer's) reads as before, its branches dated by `updated_at`; a malformed one is refused."""
    from vllm_mlx_persist.chain import branches_of

    s = open_store(tmp_path)
    ids = ["aa" * 32, "bb" * 32]
    listed = [{"block_ids": ids[:1], "n_tokens": 16, "links": [[0, "a"]], "last_used": 5.5},
              {"block_ids": ids, "n_tokens": 20, "links": [[0, "a"]]}]
    m = Manifest("a", ids[::-1], 20, 9.0, branches=listed)
    s.write_manifest(m)
    got = open_store(tmp_path).read_manifest("a")
    assert got == m and [b.last_used for b in branches_of(got)] == [5.5, 9.0]
    for bad in ("5", True, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            s.write_manifest(Manifest("a", ids, 16, 9.0, branches=[{**listed[0], "last_used": bad}]))
    assert s.read_manifest("a") == m


def test_agent_key_is_hashed_and_paths_stay_inside(tmp_path):
    root = tmp_path / "cache"
    s = open_store(root)
    evil = ["../../etc", "../../../../tmp/pwned", "/abs/path", "a/b", "..", "x\x00y", "é" * 128]
    for ns in evil:
        key = agent_key(ns)
        assert key != ns and len(key) == 64 and all(c in "0123456789abcdef" for c in key)
        s.write_manifest(Manifest(ns, [], 0, 1.0))
        assert s.read_manifest(ns).namespace == ns
        assert s.manifest_path(ns).resolve().parent == s.agents_dir.resolve()
    assert sorted(os.listdir(tmp_path)) == ["cache"]
    assert len(os.listdir(s.agents_dir)) == len(evil)
    assert sorted(m.namespace for m in s.list_manifests()) == sorted(evil)


# --- integrity: bad files are quarantined misses ---------------------------------------------


def test_truncated_block_is_quarantined_miss(tmp_path, caplog):
    s = open_store(tmp_path)
    blk = make_block(7)
    s.write_block(blk)
    p = s.block_path(blk.block_id)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_persist.store"):
        assert s.read_block(blk.block_id) is None
    assert any("quarantined" in r.getMessage() for r in caplog.records)
    assert not p.exists() and not s.has_block(blk.block_id)
    q = quarantined(s)
    assert len(q) == 1 and q[0].startswith(f"{blk.block_id}.safetensors.")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_persist.store"):
        assert s.read_block(blk.block_id) is None  # clean miss the second time
    assert caplog.records == [] and len(quarantined(s)) == 1


@pytest.mark.parametrize("where", ["length", "header", "tokens", "data", "last"])
def test_flipped_byte_is_quarantined_miss(tmp_path, where):
    s = open_store(tmp_path)
    blk = make_block(8)
    s.write_block(blk)
    p = s.block_path(blk.block_id)
    raw = bytearray(p.read_bytes())
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    start = 8 + hlen
    pos = {"length": 0, "header": 8 + hlen // 2, "tokens": start + header["tokens"]["data_offsets"][0] + 1,
           "data": start + header["0.v.q"]["data_offsets"][0] + 5, "last": len(raw) - 1}[where]
    raw[pos] ^= 0x10
    p.write_bytes(bytes(raw))
    assert s.read_block(blk.block_id) is None
    assert len(quarantined(s)) == 1 and not p.exists()


def _split(raw: bytes) -> tuple[dict, bytes]:
    hlen = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + hlen]), raw[8 + hlen:]


def _join(header: dict, data: bytes) -> bytes:
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-(8 + len(hbytes)) % 8)
    return len(hbytes).to_bytes(8, "little") + hbytes + data


def _as_sha256(raw: bytes) -> bytes:
    """The block file an earlier build wrote: the same file with the sha256 checksum."""
    header, data = _split(raw)
    meta = header["__metadata__"]
    names = sorted(n for n in header if n != "__metadata__")
    tensors = [(n, header[n]["dtype"], header[n]["shape"], memoryview(data)[slice(*header[n]["data_offsets"])])
               for n in names]
    meta["checksum"] = disk_format.block_sha256(meta["block_id"], int(meta["n_tokens"]),
                                              json.loads(meta["dtypes"]), tensors)
    return _join(header, data)


def _put(s: DiskStore, blk: BlockData, raw: bytes) -> Path:
    p = s.block_path(blk.block_id)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(raw)
    return p


def test_blocks_written_with_sha256_are_still_read(tmp_path):
    """Blocks from builds before the crc32 check carry a sha256 checksum: read and verified as
    such (a flipped data byte is still caught); a checksum of no known kind is a bad file."""
    s = open_store(tmp_path)
    blk, other = make_block(21), make_block(22)
    raw = _as_sha256(disk_format.encode_block(blk))
    assert _split(raw)[0]["__metadata__"]["checksum"].startswith("sha256:")
    _put(s, blk, raw)
    assert_same(blk, s.read_block(blk.block_id))
    header, data = _split(raw)
    data = bytearray(data)
    data[header["0.k.q"]["data_offsets"][0] + 3] ^= 0x01
    p = _put(s, blk, _join(header, bytes(data)))
    assert s.read_block(blk.block_id) is None and not p.exists()
    header, data = _split(disk_format.encode_block(other))
    header["__metadata__"]["checksum"] = "md5:" + "0" * 32
    _put(s, other, _join(header, data))
    assert s.read_block(other.block_id) is None
    assert len(quarantined(s)) == 2


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_swapped_tensor_offsets_are_caught(tmp_path, checksum):
    """A header whose offsets of two same-sized tensors are swapped still parses and covers the
    data exactly; the checksum (it covers the offsets, or the data in name order) catches it."""
    s = open_store(tmp_path)
    blk = make_block(23)
    raw = disk_format.encode_block(blk)
    raw = _as_sha256(raw) if checksum == "sha256" else raw
    header, data = _split(raw)
    a, b = header["0.k.q"], header["0.v.q"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    p = _put(s, blk, _join(header, data))
    assert s.read_block(blk.block_id) is None and not p.exists()


def test_block_renamed_to_another_id_is_a_miss(tmp_path):
    s = open_store(tmp_path)
    a, b = make_block(9), make_block(10)
    s.write_block(a)
    dest = s.block_path(b.block_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(s.block_path(a.block_id), dest)
    assert s.read_block(b.block_id) is None
    assert s.read_block(a.block_id) is None
    assert len(quarantined(s)) == 1


def test_garbage_and_empty_block_files(tmp_path):
    s = open_store(tmp_path)
    for i, content in enumerate([b"", b"\x00" * 7, b"\xff" * 64, (10).to_bytes(8, "little") + b"{not json}",
                                 (2).to_bytes(8, "little") + b"[]"]):
        bid = f"{i:02x}" * 32
        p = s.block_path(bid)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        assert s.read_block(bid) is None
        assert not p.exists()
    assert len(quarantined(s)) == 5


def test_block_from_other_format_version_is_a_miss(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    blk = make_block(11)
    monkeypatch.setattr(disk_format, "FORMAT_VERSION", 2)
    s.write_block(blk)
    monkeypatch.setattr(disk_format, "FORMAT_VERSION", 1)
    assert s.read_block(blk.block_id) is None
    assert len(quarantined(s)) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "not_json", "edit_field"])
def test_bad_manifest_is_quarantined_miss(tmp_path, damage):
    s = open_store(tmp_path)
    s.write_manifest(Manifest("agent", ["aa" * 32], 256, 1.0))
    s.write_manifest(Manifest("other", [], 0, 1.0))
    p = s.manifest_path("agent")
    raw = p.read_bytes()
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        i = raw.index(b"aaaa")
        raw = raw[:i] + b"b" + raw[i + 1:]
    elif damage == "not_json":
        raw = b"\x00garbage"
    else:
        body = json.loads(raw)
        body["n_tokens"] = 999
        raw = json.dumps(body).encode()
    p.write_bytes(raw)
    assert s.read_manifest("agent") is None
    assert len(quarantined(s)) == 1 and not p.exists()
    assert s.read_manifest("agent") is None
    assert [m.namespace for m in s.list_manifests()] == ["other"]


def test_manifest_under_wrong_key_is_a_miss(tmp_path):
    s = open_store(tmp_path)
    s.write_manifest(Manifest("alice", ["aa" * 32], 256, 1.0))
    os.replace(s.manifest_path("alice"), s.manifest_path("bob"))
    assert s.read_manifest("bob") is None  # never serve alice's cache to bob
    assert s.read_manifest("alice") is None
    assert s.list_manifests() == []


def test_list_manifests_quarantines_bad_and_skips(tmp_path):
    s = open_store(tmp_path)
    for ns in ("a", "b", "c"):
        s.write_manifest(Manifest(ns, [], 0, 1.0))
    s.manifest_path("b").write_text("{}")
    (s.agents_dir / "stray.json").write_text("[1, 2]")
    (s.agents_dir / "README.txt").write_text("not a manifest")
    assert sorted(m.namespace for m in s.list_manifests()) == ["a", "c"]
    assert len(quarantined(s)) == 2


# --- model identity --------------------------------------------------------------------------


def test_other_fingerprint_same_prefix_is_refused(tmp_path):
    open_store(tmp_path, FP)
    other = FP[:32] + "cd" * 16
    with pytest.raises(ModelMismatchError, match="another model"):
        open_store(tmp_path, other)
    open_store(tmp_path, "ef" * 32)  # a different prefix is simply another directory


def test_other_format_version_is_refused(tmp_path):
    s = open_store(tmp_path)
    p = s.dir / "model.json"
    info = json.loads(p.read_text())
    info["format_version"] = FORMAT_VERSION + 1
    p.write_text(json.dumps(info))
    with pytest.raises(ModelMismatchError, match="format version"):
        open_store(tmp_path)


def test_unreadable_model_json_is_refused(tmp_path):
    s = open_store(tmp_path)
    (s.dir / "model.json").write_text("{trunc")
    with pytest.raises(StoreError, match="unreadable"):
        open_store(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_model_directory_the_user_cannot_read_is_refused(tmp_path):
    s = open_store(tmp_path)
    s.dir.chmod(0)
    try:
        with pytest.raises(StoreError, match="Permission denied"):
            open_store(tmp_path)
    finally:
        s.dir.chmod(0o700)


# --- write failures --------------------------------------------------------------------------


def test_full_disk_raises_store_write_error_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE with SIGXFSZ ignored makes write() fail with EFBIG, as a full disk would (works as root)."""
    code = f"""
        import errno, json, os, resource, signal, sys
        import numpy as np
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from test_store import make_block, open_store
        from vllm_mlx_persist.disk_format import Manifest
        from vllm_mlx_persist.store import StoreWriteError
        from pathlib import Path
        s = open_store(Path({str(tmp_path)!r}))
        big, small = make_block(20, n_tokens=2048, layers=4), make_block(21, n_tokens=4, layers=1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        out = {{}}
        try:
            s.write_block(big)
            out["big"] = "written"
        except StoreWriteError as e:
            out["big"] = [isinstance(e, OSError), e.errno]
        out["has_big"] = s.has_block(big.block_id)
        out["tmp_after_fail"] = os.listdir(s.tmp_dir)
        out["small"] = s.write_block(small) > 0
        ns = "x" * 100
        try:
            s.write_manifest(Manifest(ns, [big.block_id] * 2000, 1, 1.0))
            out["manifest"] = "written"
        except StoreWriteError as e:
            out["manifest"] = e.errno
        out["manifest_visible"] = s.read_manifest(ns) is not None
        out["tmp_end"] = os.listdir(s.tmp_dir)
        print(json.dumps(out))
    """
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["big"] == [True, 27]  # EFBIG
    assert out["has_big"] is False and out["tmp_after_fail"] == []
    assert out["small"] is True
    assert out["manifest"] == 27 and out["manifest_visible"] is False
    assert out["tmp_end"] == []
    s = open_store(tmp_path)
    assert s.read_block(make_block(20, n_tokens=2048, layers=4).block_id) is None
    assert_same(make_block(21, n_tokens=4, layers=1), s.read_block(make_block(21, n_tokens=4, layers=1).block_id))
    assert quarantined(s) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_raises_store_write_error(tmp_path):
    s = open_store(tmp_path)
    os.chmod(s.tmp_dir, 0o500)
    try:
        with pytest.raises(StoreWriteError):
            s.write_block(make_block(22))
    finally:
        os.chmod(s.tmp_dir, 0o700)
    assert not s.has_block(make_block(22).block_id)


def test_sigkill_mid_write_leaves_only_complete_blocks(tmp_path):
    """A writer killed mid-file: every completed block reads back exactly; nothing partial is visible."""
    code = f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from pathlib import Path
        from test_store import make_block, open_store
        s = open_store(Path({str(tmp_path)!r}))
        i = 0
        while True:
            blk = make_block(100 + i, n_tokens=256, layers=48, heads=8, head_dim=128)  # ~ 17 MB
            s.write_block(blk)
            print(i, blk.block_id, flush=True)
            i += 1
    """
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done: list[str] = []

    def reader():
        for line in proc.stdout:
            done.append(line.split()[1])

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    tmp_dir = tmp_path / FP[:32] / "tmp"
    saw_partial = False
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if len(done) >= 2 and tmp_dir.is_dir():
                sizes = []
                for name in os.listdir(tmp_dir):
                    try:
                        sizes.append((tmp_dir / name).stat().st_size)
                    except FileNotFoundError:
                        pass
                if any(0 < sz < 8 << 20 for sz in sizes):  # a block file half written
                    os.kill(proc.pid, signal.SIGKILL)
                    saw_partial = True
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.0005)
        else:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t.join(5)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert len(done) >= 2
    leftovers = os.listdir(tmp_dir)
    assert saw_partial and leftovers, "the kill did not land mid-write"

    s = open_store(tmp_path)  # fresh store on the same dir: leftovers are garbage
    assert os.listdir(s.tmp_dir) == []
    for i, bid in enumerate(done):
        expect = make_block(100 + i, n_tokens=256, layers=48, heads=8, head_dim=128)
        assert expect.block_id == bid
        assert_same(expect, s.read_block(bid))
    # The block being written when killed is absent or complete, never partial.
    on_disk = set(s.iter_block_ids())
    assert set(done) <= on_disk and len(on_disk - set(done)) <= 1
    for bid in on_disk - set(done):
        assert s.read_block(bid) is not None
    assert quarantined(s) == []


def test_tmp_leftovers_of_live_process_are_kept(tmp_path):
    s = open_store(tmp_path)
    mine = s.tmp_dir / f"block.{os.getpid()}.{'0' * 32}.tmp"
    dead = s.tmp_dir / f"block.{2**22 + 12345}.{'1' * 32}.tmp"  # beyond pid_max defaults
    junk = s.tmp_dir / "junk"
    for p in (mine, dead, junk):
        p.write_bytes(b"partial")
    open_store(tmp_path)
    assert sorted(os.listdir(s.tmp_dir)) == [mine.name]
    old = time.time() - quarantine_mod.STALE_TMP_S - 10
    os.utime(mine, (old, old))
    s.gc(set())
    assert os.listdir(s.tmp_dir) == []


# --- gc, usage -------------------------------------------------------------------------------


def test_gc_deletes_only_dead_blocks(tmp_path):
    s = open_store(tmp_path)
    blocks = [make_block(30 + i) for i in range(5)]
    for b in blocks:
        s.write_block(b)
    ids = [b.block_id for b in blocks]
    s.write_manifest(Manifest("agent", [ids[0], ids[1]], 32, 1.0))
    assert s.gc({ids[2]}) == 2  # live: named by the manifest or by the caller
    for i in (0, 1, 2):
        assert_same(blocks[i], s.read_block(ids[i]))
    assert not s.has_block(ids[3]) and not s.has_block(ids[4])
    assert s.gc({ids[2]}) == 0
    s.delete_manifest("agent")
    assert s.gc(set()) == 3
    assert list(s.iter_block_ids()) == []


def test_disk_bytes_and_stats(tmp_path):
    s = open_store(tmp_path)
    base = s.disk_bytes()
    n = s.write_block(make_block(40))
    assert s.disk_bytes() == base + n
    s.write_manifest(Manifest("a", [make_block(40).block_id], 16, 1.0))
    st = s.stats()
    assert st["blocks_files"] == 1 and st["blocks_bytes"] == n
    assert st["agents_files"] == 1 and st["disk_bytes"] == s.disk_bytes() > base + n
    assert st["block_writes"] == 1 and st["manifest_writes"] == 1 and st["format_version"] == 1


def test_concurrent_reads_and_writes(tmp_path):
    s = open_store(tmp_path)
    blocks = [make_block(50 + i) for i in range(16)]
    errors = []

    def work(part):
        try:
            for b in part:
                s.write_block(b)
                assert_same(b, s.read_block(b.block_id))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(blocks[i % 2::2] + blocks,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(s.tmp_dir) == [] and quarantined(s) == []


def _try_lock_elsewhere(root: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from vllm_mlx_persist.cache_root import CacheDirLock\n"
            "from vllm_mlx_persist.store import StoreError\n"
            "try:\n    CacheDirLock(sys.argv[1])\nexcept StoreError as e:\n    print(e); sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)


def test_cache_dir_lock_one_process_at_a_time(tmp_path):
    """Another process cannot take a held cache root (and is told which pid holds it); the same
    process can (a rebuilt backend); the lock goes with the last holder, or with the process."""
    root = tmp_path / "cache"
    first = CacheDirLock(root)
    second = CacheDirLock(root)  # same process: shared
    r = _try_lock_elsewhere(root)
    assert r.returncode == 3 and f"in use by another server (pid {os.getpid()})" in r.stdout, r
    first.release()
    first.release()  # idempotent per holder
    assert _try_lock_elsewhere(root).returncode == 3  # `second` still holds it
    second.release()
    r = _try_lock_elsewhere(root)
    assert r.returncode == 0, r
    # A holder killed with SIGKILL leaves no stale lock behind.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from vllm_mlx_persist.cache_root import "
                               "CacheDirLock; CacheDirLock(sys.argv[1]); print('held', flush=True); "
                               "time.sleep(600)", str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _try_lock_elsewhere(root).returncode == 3
    finally:
        holder.kill()
        holder.wait()
    assert _try_lock_elsewhere(root).returncode == 0


def test_quarantine_is_pruned_at_open(tmp_path):
    """Quarantined files stay for inspection, but at most QUARANTINE_KEEP_FILES of them and none
    older than QUARANTINE_KEEP_S; the newest survive."""
    s = open_store(tmp_path)
    now = time.time()
    n_old, n_new = 5, quarantine_mod.QUARANTINE_KEEP_FILES + 10
    for i in range(n_old):
        p = s.quarantine_dir / f"old{i}"
        p.write_bytes(b"x")
        os.utime(p, (now - quarantine_mod.QUARANTINE_KEEP_S - 60, now - quarantine_mod.QUARANTINE_KEEP_S - 60))
    for i in range(n_new):
        p = s.quarantine_dir / f"new{i:04d}"
        p.write_bytes(b"x")
        os.utime(p, (now - i, now - i))  # new0000 is the newest
    open_store(tmp_path)
    left = sorted(p.name for p in s.quarantine_dir.iterdir())
    assert left == [f"new{i:04d}" for i in range(quarantine_mod.QUARANTINE_KEEP_FILES)]


def test_cache_is_private_to_its_owner(tmp_path):
    """Token ids and KV can be decoded back to the conversation: directories 0700, files 0600."""
    root = tmp_path / "root"
    lock = CacheDirLock(root)
    s = open_store(root)
    s.write_block(make_block(3))
    s.write_manifest(Manifest("agent-1", [make_block(3).block_id], 16, time.time()))
    paths = [root, *root.rglob("*")]
    assert any(p.suffix == ".safetensors" for p in paths) and any(p.name == ".lock" for p in paths)
    for p in paths:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    lock.release()
    root.chmod(0o755)  # a root left open by hand (or by an older version) is closed again
    CacheDirLock(root).release()
    assert root.stat().st_mode & 0o777 == 0o700


# --- hostile files: FIFOs, links, deep JSON, oversized files (issue #12) ----------------------


def no_hang(fn, *args, timeout: float = 30):
    """Run fn(*args) on a thread; fail (rather than hang the suite) if it does not return in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised on the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung for {timeout}s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _plant(path: Path, kind: str, good: Path) -> None:
    """Put a non-regular file of `kind` at `path` (good: a sound file of the same kind to link to)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_fifo":
        target = path.with_name("target.fifo")
        if not target.exists():
            os.mkfifo(target)
        os.symlink(target, path)
    elif kind == "symlink_file":
        os.symlink(good, path)
    elif kind == "symlink_dev":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "chardev":
        try:
            os.mknod(path, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 5))  # like /dev/zero
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")


NON_REGULAR = ["fifo", "symlink_fifo", "symlink_file", "symlink_dev", "directory", "chardev"]


@pytest.mark.parametrize("kind", NON_REGULAR)
def test_non_regular_block_file_is_quarantined_without_blocking(tmp_path, kind):
    """A FIFO (or a link to one, or a device) where a block file should be must not hang the
    reader: it is moved aside unread, the read is a miss, and a write replaces it."""
    s = open_store(tmp_path)
    other, blk = make_block(40), make_block(41)
    s.write_block(other)
    path = s.block_path(blk.block_id)
    _plant(path, kind, s.block_path(other.block_id))
    assert no_hang(s.read_block, blk.block_id) is None
    assert not os.path.lexists(path) and len(quarantined(s)) == 1
    assert s.stats()["quarantined"] == 1
    assert_same(other, s.read_block(other.block_id))  # a link's target is untouched
    _plant(path, kind, s.block_path(other.block_id))
    assert no_hang(s.write_block, blk) > 0  # the writer's "already there?" check must not block either
    assert_same(blk, s.read_block(blk.block_id))


@pytest.mark.parametrize("kind", NON_REGULAR)
def test_non_regular_manifest_is_quarantined_and_load_proceeds(tmp_path, kind):
    s = open_store(tmp_path)
    s.write_manifest(Manifest("good", [], 0, 1.0))
    s.write_manifest(Manifest("victim", [], 0, 1.0))
    path = s.manifest_path("victim")
    path.unlink()
    _plant(path, kind, s.manifest_path("good"))
    assert [m.namespace for m in no_hang(s.list_manifests)] == ["good"]
    assert not os.path.lexists(path) and len(quarantined(s)) == 1
    assert no_hang(s.read_manifest, "victim") is None


@pytest.mark.parametrize("kind", ["fifo", "symlink_fifo", "directory", "symlink_file"])
def test_non_regular_model_json_is_refused_without_blocking(tmp_path, kind):
    s = open_store(tmp_path)
    good = tmp_path / "good.json"
    os.replace(s.dir / "model.json", good)
    _plant(s.dir / "model.json", kind, good)
    with pytest.raises(StoreError, match="model.json is unreadable .*not a regular file"):
        no_hang(open_store, tmp_path)


def test_non_regular_entries_in_quarantine_are_pruned(tmp_path, monkeypatch):
    """Quarantined FIFOs, links and directories count against the bounds like files do."""
    s = open_store(tmp_path)
    for kind in ("fifo", "symlink_dev", "directory"):
        _plant(s.quarantine_dir / kind, kind, s.dir / "model.json")
    (s.quarantine_dir / "directory" / "inner").write_bytes(b"x")
    monkeypatch.setattr(quarantine_mod, "QUARANTINE_KEEP_FILES", 1)
    open_store(tmp_path)
    assert len(quarantined(s)) == 1


DEEP = b"[" * 100_000


def test_deeply_nested_json_manifest_is_quarantined_and_load_proceeds(tmp_path):
    s = open_store(tmp_path)
    for ns in ("a", "b"):
        s.write_manifest(Manifest(ns, [], 0, 1.0))
    s.manifest_path("a").write_bytes(DEEP)
    (s.agents_dir / ("0" * 64 + ".json")).write_bytes(b'{"x": ' + DEEP + b"}")
    assert [m.namespace for m in s.list_manifests()] == ["b"]
    assert len(quarantined(s)) == 2
    assert s.read_manifest("a") is None


def test_deeply_nested_json_block_header_is_quarantined(tmp_path):
    s = open_store(tmp_path)
    blk = make_block(42)
    path = s.block_path(blk.block_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    for header in (DEEP, b'{"__metadata__": ' + DEEP + b"}", b'{"t": {"data_offsets": [0, ' + DEEP + b"]}}"):
        path.write_bytes(len(header).to_bytes(8, "little") + header)
        assert s.write_block(blk) > 0  # the "already there?" check treats it as absent
        path.write_bytes(len(header).to_bytes(8, "little") + header)
        assert s.read_block(blk.block_id) is None
        assert not path.exists()
    assert len(quarantined(s)) == 3


def test_deeply_nested_model_json_is_refused(tmp_path):
    s = open_store(tmp_path)
    (s.dir / "model.json").write_bytes(DEEP)
    with pytest.raises(StoreError, match="unreadable"):
        open_store(tmp_path)


def test_oversized_block_is_refused_before_its_data_is_read(tmp_path, monkeypatch):
    """A sound header followed by 512 MiB (sparse) of padding, a file over the cap, and a header
    that claims more data than the file holds: all quarantined having read at most the header."""
    s = open_store(tmp_path)
    read_sizes: list[int] = []
    real_read_exact = store_mod.read_exact
    monkeypatch.setattr(store_mod, "read_exact",
                        lambda fd, size, offset=0: read_sizes.append(size) or real_read_exact(fd, size, offset))
    blk = make_block(43)
    s.write_block(blk)
    path = s.block_path(blk.block_id)
    good_size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(512 << 20)
    assert s.read_block(blk.block_id) is None
    assert max(read_sizes) < 64 << 10, read_sizes  # 8 bytes, then the header: never the data
    assert s.stats()["bytes_read"] == 0

    s.write_block(blk)
    s.max_block_bytes = good_size - 1
    read_sizes.clear()
    assert s.read_block(blk.block_id) is None
    assert read_sizes == []  # refused on fstat alone
    with pytest.raises(StoreWriteError, match="block cap"):  # and never written beyond what can be read
        s.write_block(make_block(44))
    s.max_block_bytes = disk_format.MAX_BLOCK_BYTES

    s.write_block(blk)
    with open(path, "r+b") as f:
        f.truncate(good_size - 1)  # header says more than the file holds
    assert s.read_block(blk.block_id) is None
    assert len(quarantined(s)) == 3
    s.write_block(blk)
    assert_same(blk, s.read_block(blk.block_id))


def test_oversized_manifest_is_quarantined_unread_and_never_written(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    s.write_manifest(Manifest("big", ["ab" * 32] * 10, 2560, 1.0))
    s.write_manifest(Manifest("small", [], 0, 1.0))
    with open(s.manifest_path("big"), "r+b") as f:
        f.truncate(disk_format.MAX_MANIFEST_BYTES + 1)  # sparse
    assert [m.namespace for m in s.list_manifests()] == ["small"]
    assert len(quarantined(s)) == 1
    monkeypatch.setattr(store_mod, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(StoreWriteError, match="manifest cap"):
        s.write_manifest(Manifest("big", ["ab" * 32] * 20, 5120, 1.0))
    assert not s.manifest_path("big").exists() and os.listdir(s.tmp_dir) == []


@pytest.mark.parametrize("case", ["root_is_file", "lock_is_dir", "lock_is_fifo", "lock_is_symlink",
                                  "parent_is_file"])
def test_unusable_cache_root_is_refused_in_one_clear_line(tmp_path, case):
    root = tmp_path / "root"
    if case == "root_is_file":
        root.write_text("x")
        match = "exists and is not a directory"
    elif case == "parent_is_file":
        (tmp_path / "file").write_text("x")
        root = tmp_path / "file" / "root"
        match = "cannot create the cache directory .*Not a directory"
    else:
        root.mkdir()
        lock = root / ".lock"
        {"lock_is_dir": lock.mkdir, "lock_is_fifo": lambda: os.mkfifo(lock),
         "lock_is_symlink": lambda: os.symlink(tmp_path / "elsewhere", lock)}[case]()
        match = r"cannot lock the cache directory: .*\.lock"
    with pytest.raises(StoreError, match=match) as e:
        no_hang(CacheDirLock, root)
    assert "\n" not in str(e.value) and str(root) in str(e.value)


# ---------------------------------------------------------------------------------------------
# Injected I/O errors (faults.py, the hook the reliability campaigns use)


def test_fault_hook_is_off_unless_the_environment_names_one():
    assert store_mod._FAULT is None
    r = run_py("""
        from vllm_mlx_persist import store
        print(store._FAULT is not None)
    """)
    assert r.stdout.strip() == "False"
    env_spec = "EIO:read@/nonexistent;kill@3"
    r = subprocess.run([sys.executable, "-c", "from vllm_mlx_persist import store; print(store._FAULT is not None)"],
                       env=dict(os.environ, PYTHONPATH=str(REPO), VLLM_MLX_PERSIST_FAULT=env_spec),
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "True" and "fault injection ON" in r.stderr


@pytest.mark.parametrize("spec", ["EIO", "EIO:read", "NOPE:read@/x", "EIO:seek@/x", "kill@x", "kill@2:seek",
                                  "hold:read", "hold:seek@/x"])
def test_malformed_fault_spec_is_refused(spec):
    from vllm_mlx_persist import faults

    with pytest.raises(ValueError):
        faults.parse(spec)


def test_a_hold_fault_holds_its_steps_until_the_switch_is_removed(tmp_path):
    """hold:steps@switch (a stuck disk the test releases): those steps wait while the switch exists;
    other steps, and every step once it is gone, pass."""
    from vllm_mlx_persist import faults

    switch = tmp_path / "stuck"
    switch.touch()
    hook = faults.parse(f"hold:read@{switch}")
    hook("write")  # not held
    passed = threading.Event()
    t = threading.Thread(target=lambda: (hook("read"), passed.set()), daemon=True)
    t.start()
    hook("open")  # a later step of another kind passes: the reader is still held
    assert not passed.is_set() and t.is_alive()
    switch.unlink()
    assert passed.wait(30)
    hook("read")  # released for good


def test_a_kind_targeted_kill_counts_only_its_kind():
    """kill@N:kind (the crash campaign's deterministic trials): the Nth step of that kind, whatever
    other steps come before it. Checked in a child, which the hook SIGKILLs."""
    r = run_py("""
        import os
        from vllm_mlx_persist import faults
        hook = faults.parse("kill@2:dirsync")
        for step in ["open", "write", "fsync", "rename", "dirsync", "read", "open", "write", "fsync",
                     "rename", "dirsync", "open"]:
            print(step, flush=True)
            hook(step)
    """)
    assert r.returncode == -9 and r.stdout.split()[-1] == "dirsync" and r.stdout.count("dirsync") == 2
    assert "FAULT kill before write step 2 (dirsync)" in r.stderr


def test_injected_read_error_is_a_miss_that_keeps_a_sound_file(tmp_path, monkeypatch):
    """Regression: an EIO while reading a block used to quarantine the file as if its bytes were bad,
    so a transient device error cost the agent its cache for good. Now it is a miss, counted in
    read_errors, and the block reads back once the device recovers. Same for manifests."""
    from vllm_mlx_persist import faults

    s = open_store(tmp_path)
    b = make_block(1)
    s.write_block(b)
    s.write_manifest(Manifest("alice", [b.block_id], 16, 1.0))
    switch = tmp_path / "eio"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"EIO:read@{switch}"))
    assert s.read_block(b.block_id) is None
    assert s.read_manifest("alice") is None
    assert s.stats()["read_errors"] == 2 and quarantined(s) == []
    switch.unlink()
    assert_same(b, s.read_block(b.block_id))
    assert s.read_manifest("alice").block_ids == [b.block_id]


@pytest.mark.parametrize("step", ["open", "write", "fsync", "rename", "dirsync"])
def test_injected_write_error_at_each_step_leaves_no_temp_file(tmp_path, monkeypatch, step):
    from vllm_mlx_persist import faults

    s = open_store(tmp_path)
    switch = tmp_path / "enospc"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"ENOSPC:{step}@{switch}"))
    b = make_block(2)
    with pytest.raises(StoreWriteError) as e:
        s.write_block(b)
    assert e.value.errno == 28 and os.listdir(s.tmp_dir) == []
    assert s.stats()["write_errors"] == 1
    switch.unlink()
    s.write_block(b)
    assert_same(b, s.read_block(b.block_id))


class HeldClock:
    """A Persister's retry_clock that stands still until the test moves it on: a failed save's retry
    is due only then, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until_no_retry(p, what: str) -> None:
    deadline = time.monotonic() + 30  # turns a hang into a failure
    while p.stats()["saves_retrying"]:
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_retried_older_save_never_overwrites_a_newer_turn(tmp_path, monkeypatch):
    """Regression (found by the disk campaign): turn 0's save fails (disk full) and waits for its retry;
    the disk recovers and turn 1 is saved and acknowledged; then turn 0's retry ran and put its older
    manifest back, so after a restart the agent had lost turn 1. Now the retry writes its blocks
    (turn 1's manifest names them) but not its manifest."""
    from vllm_mlx_persist import faults
    from vllm_mlx_persist.persister import Persister

    s = open_store(tmp_path)
    clock = HeldClock()
    p = Persister(s, disk_budget=1 << 40, retry_delays=(0.3,), retry_clock=clock)
    p.load()
    switch = tmp_path / "enospc"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"ENOSPC:write@{switch}"))
    b0, b1 = make_block(10), make_block(11)
    first = p.save(Manifest("alice", [b0.block_id], 16, 1.0), [b0], [], lambda: None)
    assert first.result(10) is False  # failed; a retry is queued
    switch.unlink()
    second = p.save(Manifest("alice", [b0.block_id, b1.block_id], 32, 2.0), [b1], [], lambda: None)
    assert second.result(10) is True and p.stats()["saves_retrying"] == 1
    clock.now += 1.0  # turn 0's retry is due: after turn 1's save
    assert p.flush(10)
    wait_until_no_retry(p, "turn 0's retry did not run")  # ran, not given up at close: saves_superseded below
    p.close()
    reopened = open_store(tmp_path)
    assert reopened.read_manifest("alice").block_ids == [b0.block_id, b1.block_id]
    assert_same(b0, reopened.read_block(b0.block_id))  # written by the superseded retry
    assert p.counts["saves_superseded"] == 1


def test_an_erasure_that_drops_a_queued_retry_leaves_no_block_behind(tmp_path, monkeypatch):
    """Regression (found by the state machine): turn 1's save failed and waited for its retry; turn 2's
    save made turn 0's block dead, but left its file, since the queued retry's manifest still named it;
    then the agent was erased, which dropped the retry and deleted only what turn 2's manifest named.
    Turn 0's block stayed on disk, unnamed, and counted in the disk's bytes until the next start. Now
    the erasure also deletes what only the saves it drops named or carried."""
    from vllm_mlx_persist import faults
    from vllm_mlx_persist.persister import Persister

    s = open_store(tmp_path)
    p = Persister(s, disk_budget=1 << 40, retry_delays=(30.0,))  # the retry waits while the rest runs
    p.load()
    b0, b1, b2 = make_block(30), make_block(31), make_block(32)
    assert p.save(Manifest("alice", [b0.block_id], 16, 1.0), [b0], [], lambda: None).result(10)
    switch = tmp_path / "eio"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"EIO:write@{switch}"))
    retried = p.save(Manifest("alice", [b1.block_id, b0.block_id], 32, 2.0), [b1], [], lambda: None)
    assert retried.result(10) is False and p.stats()["saves_retrying"] == 1
    switch.unlink()
    assert p.save(Manifest("alice", [b2.block_id], 16, 3.0), [b2], [b0.block_id], lambda: None).result(10)
    assert s.has_block(b0.block_id)  # the queued retry still names it
    assert p.erase("alice").result(10) is True
    assert p.stats()["saves_retrying"] == 0
    assert sorted(s.iter_block_ids()) == [] and p.stats()["disk_blocks"] == 0
    p.close()


@pytest.mark.parametrize("retry", ["superseded", "given up"])
def test_a_retry_that_writes_no_manifest_leaves_no_block_behind(tmp_path, monkeypatch, retry):
    """The same leak when the retry itself leaves the queue without its manifest: superseded by the
    newer turn (it writes its blocks, not its manifest), or given up. Turn 0's block, which the newer
    turn's save left for it, stays on disk, unnamed and counted; now it goes with the retry."""
    from vllm_mlx_persist import faults
    from vllm_mlx_persist.persister import Persister

    s = open_store(tmp_path)
    clock = HeldClock()
    p = Persister(s, disk_budget=1 << 40, retry_delays=(0.5,), retry_clock=clock)
    p.load()
    b0, b1, b2 = make_block(40), make_block(41), make_block(42)
    assert p.save(Manifest("alice", [b0.block_id], 16, 1.0), [b0], [], lambda: None).result(10)
    switch = tmp_path / "eio"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"EIO:write@{switch}"))
    assert p.save(Manifest("alice", [b1.block_id, b0.block_id], 32, 2.0), [b1], [], lambda: None).result(10) is False
    switch.unlink()
    assert p.save(Manifest("alice", [b2.block_id], 16, 3.0), [b2], [b0.block_id], lambda: None).result(10)
    assert s.has_block(b0.block_id)  # the queued retry still names it
    if retry == "given up":
        switch.touch()
    assert p.stats()["saves_retrying"] == 1
    clock.now += 1.0  # the retry is due: after the newer turn's save
    assert p.flush(10)
    wait_until_no_retry(p, "the retry did not run")
    assert p.flush(10)
    assert p.counts["saves_superseded" if retry == "superseded" else "saves_dropped"] == 1
    assert sorted(s.iter_block_ids()) == [b2.block_id] and p.stats()["disk_blocks"] == 1
    p.close()


def test_a_save_queued_after_an_erasure_of_its_agent_is_kept(tmp_path, monkeypatch):
    """Regression (found by the state machine): an erasure dropped every save of its agent still queued,
    those queued after it too: turns of the agent made anew once the pool had forgotten it (the pool
    stores no turn of a request in flight during the erasure). Such a turn was never saved, on a sound
    disk, until the agent's next one. Now only saves queued before the erasure go."""
    import threading

    from vllm_mlx_persist.persister import Persister

    s = open_store(tmp_path)
    p = Persister(s, disk_budget=1 << 40)
    p.load()
    p.flush()
    b0, b1 = make_block(40), make_block(41)
    go = threading.Event()
    monkeypatch.setattr(store_mod, "_FAULT", lambda step: go.wait(10))  # the writer held inside the first save
    first = p.save(Manifest("alice", [b0.block_id], 16, 1.0), [b0], [], lambda: None)
    erased = p.erase("alice")
    again = p.save(Manifest("alice", [b1.block_id], 16, 2.0), [b1], [], lambda: None)
    monkeypatch.setattr(store_mod, "_FAULT", None)
    go.set()
    assert first.result(10) is True and erased.result(10) is True
    assert again.result(10) is True
    assert s.read_manifest("alice").block_ids == [b1.block_id]
    assert sorted(s.iter_block_ids()) == [b1.block_id]
    p.close()


def _record_dir_syncs(monkeypatch) -> list[Path]:
    """Spy on the store's directory fsyncs (the real ones still run); returns the paths synced."""
    synced: list[Path] = []
    real = store_mod.fsync_dir

    def spy(path: Path) -> None:
        real(path)
        synced.append(Path(path))
    monkeypatch.setattr(store_mod, "fsync_dir", spy)
    return synced


def test_a_block_skipped_after_a_failed_directory_fsync_is_made_durable(tmp_path, monkeypatch):
    """Regression: a block whose write failed at the directory fsync is already renamed into place
    and valid, so its retry took the write-skip path, which never synced the directory: the retry
    succeeded and a durable manifest could name a block whose directory entry was not. Now the skip
    syncs the directory, and fails while that fails."""
    from vllm_mlx_persist import faults

    s = open_store(tmp_path)
    switch = tmp_path / "eio"
    switch.touch()
    monkeypatch.setattr(store_mod, "_FAULT", faults.parse(f"EIO:dirsync@{switch}"))
    b = make_block(20)
    s.block_path(b.block_id).parent.mkdir(parents=True)  # so the failing dirsync is the block's own
    with pytest.raises(StoreWriteError):
        s.write_block(b)
    assert s.has_block(b.block_id)  # renamed into place: the next write finds a valid copy
    with pytest.raises(StoreWriteError):  # ...but its entry is still not durable
        s.write_block(b)
    switch.unlink()
    synced = _record_dir_syncs(monkeypatch)
    assert s.write_block(b) == 0  # skipped, not rewritten
    assert s.block_path(b.block_id).parent in synced
    assert s.stats()["block_write_skips"] == 1 and s.stats()["write_errors"] == 2
    assert_same(b, s.read_block(b.block_id))


def test_a_new_shard_directory_is_made_durable_by_the_retry(tmp_path, monkeypatch):
    """The same hole one level up: a block's shard directory (blocks/ab/) created by an attempt whose
    fsync of blocks/ failed was never synced again (the retry saw the directory and went on)."""
    s = open_store(tmp_path)
    b = make_block(21)
    shard = s.block_path(b.block_id).parent
    assert not shard.exists()
    calls = [0]

    def first_dirsync_fails(step: str) -> None:
        if step == "dirsync":
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(5, "EIO (injected at the first dirsync)")
    monkeypatch.setattr(store_mod, "_FAULT", first_dirsync_fails)
    synced = _record_dir_syncs(monkeypatch)
    with pytest.raises(StoreWriteError):
        s.write_block(b)
    assert shard.is_dir()
    synced.clear()
    s.write_block(b)
    assert synced.index(s.blocks_dir) < synced.index(shard)  # the shard's entry, then the block's
    assert_same(b, s.read_block(b.block_id))


def test_a_retried_save_syncs_the_blocks_directory_before_its_manifest(tmp_path, monkeypatch):
    """The issue's path through the persister: the first attempt's block directory fsync fails, the
    retry finds the block valid; its manifest may be written only after the block's directory
    entry is durable."""
    from vllm_mlx_persist.persister import Persister

    s = open_store(tmp_path)
    b = make_block(22)
    shard = s.block_path(b.block_id).parent
    shard.mkdir(parents=True)  # the shard exists: the first dirsync is the block's own
    p = Persister(s, disk_budget=1 << 40, retry_delays=(0.2,))
    p.load()
    failed = threading.Event()

    def first_dirsync_fails(step: str) -> None:
        if step == "dirsync" and not failed.is_set():
            failed.set()
            raise OSError(5, "EIO (injected)")
    monkeypatch.setattr(store_mod, "_FAULT", first_dirsync_fails)
    synced = _record_dir_syncs(monkeypatch)
    first = p.save(Manifest("alice", [b.block_id], 16, 1.0), [b], [], lambda: None)
    assert first.result(10) is False and failed.is_set()
    deadline = time.time() + 10
    while s.read_manifest("alice") is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.flush(10)
    p.close()
    assert s.read_manifest("alice").block_ids == [b.block_id]
    assert shard in synced and s.agents_dir in synced
    assert synced.index(shard) < synced.index(s.agents_dir)
