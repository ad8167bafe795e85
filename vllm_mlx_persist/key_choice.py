"""The key format a calibration chose, remembered in the cache root: a restart of the same model with
the same calibration reads its choice back instead of running the model on the calibration text again.
It is also kept in a folder shared by every cache root of the user (`shared_dir`: the default cache
root's `key-formats/`, or $VLLM_MLX_PERSIST_SHARED_KEY_FORMATS; "off" there keeps choices per root), so
a new cache root of a model calibrated before starts at once (issue #43: 40 s on SmolLM2 on a CPU). A
choice read from there is copied into the root. The shared folder keeps the `SHARED_KEEP` newest.
Last, the package ships the choices of the project's real checkpoints as imported by `make-model`
(`SHIPPED_DIR`, written by `vllm-mlx-persist calibrate --ship`, issue #50): a first start of `./dev
serve` reads its format there instead of calibrating for minutes on a CPU. They are found by the same
key as any other (the model's weights and tokenizer, the calibration, mlx's version), so another import,
another calibration or another mlx calibrates as before ($VLLM_MLX_PERSIST_SHIPPED_KEY_FORMATS=off: never
read them, for measuring what a calibration costs).

One small JSON file per (model, calibration) under `<cache root>/key-formats/` (the `ROOT_KEEP` newest), named by a hash of the
model's q4 fingerprint and everything the calibration depends on (its text and length, candidates,
limit, mlx's version): another model, another limit or another calibration never reads it. A file
that does not parse, is for another key, or holds formats this model cannot use is ignored (the model
is calibrated again and the file rewritten); a file that cannot be written costs only the next start's
calibration. Files only, written by rename; a save cut short by a crash leaves a `.tmp-*` file that
the next save removes (the root's lock: no other save is live). The worker thread, once at load.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from .caches.key_formats import TRANSFORMS, VALUE_TRANSFORMS, LayerKeys
from .files import BadFile, read_capped

log = logging.getLogger("vllm_mlx_persist")

CHOICES_DIR = "key-formats"
SHARED_ENV = "VLLM_MLX_PERSIST_SHARED_KEY_FORMATS"
SHIPPED_DIR = Path(__file__).with_name("shipped_key_formats")  # read-only, inside the package
SHIPPED_ENV = "VLLM_MLX_PERSIST_SHIPPED_KEY_FORMATS"
SHARED_KEEP = 64  # files in the shared folder (tens of kB each); the oldest go first
ROOT_KEEP = 64  # files in a cache root's folder: a root that has served many models keeps the newest
VERSION = 1
MAX_FILE_BYTES = 8 << 20  # scales of a few hundred layers; anything larger is not ours


def choice_key(fingerprint: str, option: str, calibration: dict) -> str:
    """The file's name: a hash of the model's fingerprint, the option and what its calibration used."""
    blob = json.dumps({"v": VERSION, "model": fingerprint, "option": option, "calibration": calibration,
                       "mlx": mx.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _encode(fmt: Optional[LayerKeys]) -> Optional[dict]:
    if fmt is None:
        return None
    out: dict[str, Any] = {"bits": fmt.bits, "transform": fmt.transform}
    if fmt.values is not None:  # only when set: files written before value transforms stay valid
        out["values"] = fmt.values
    if fmt.scales is not None:
        a = np.asarray(fmt.scales, dtype=np.float32)
        out.update(shape=list(a.shape), scales=base64.b64encode(a.tobytes()).decode())
    if fmt.scales16:
        out["scales16"] = True
    if fmt.center is not None:
        out["center"] = base64.b64encode(np.asarray(fmt.center, dtype=np.float32).tobytes()).decode()
    return out


def _array(text: str, shape: tuple[int, ...], positive: bool) -> mx.array:
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.float32)
    if a.size != math.prod(shape) or not np.all(np.isfinite(a)) or (positive and not np.all(a > 0)):
        raise ValueError("scales or center of another shape, or not finite (scales: positive)")
    return mx.array(a.reshape(shape))


def _decode(d: Optional[dict], scale_shape: Optional[tuple[int, ...]]) -> Optional[LayerKeys]:
    if d is None:
        return None
    if scale_shape is None:
        raise ValueError("a format on a layer without 4-bit keys")
    bits, transform, values = d["bits"], d["transform"], d.get("values")
    if bits not in (4, 5, 6, 8) or transform not in TRANSFORMS or values not in VALUE_TRANSFORMS:
        raise ValueError(f"unknown key format {bits}/{transform}/{values}")
    scales = center = None
    if transform in ("scaled", "centred"):
        if tuple(d["shape"]) != scale_shape:
            raise ValueError("scales of another shape")
        scales = _array(d["scales"], scale_shape, positive=True)
    if transform == "centred":
        center = _array(d["center"], scale_shape, positive=False)
    scales16 = d.get("scales16", False)
    if scales16 not in (True, False):
        raise ValueError("scales16 must be true or false")
    return LayerKeys(bits, transform, scales, values, center, scales16)


def shared_dir() -> Optional[Path]:
    """The folder every cache root's choices are also kept in, or None when switched off."""
    env = os.environ.get(SHARED_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else Path(os.path.expanduser(env))
    from .options import default_cache_dir

    return default_cache_dir() / CHOICES_DIR


def load(root: Path, key: str,
         scale_shapes: Sequence[Optional[tuple[int, ...]]]) -> Optional[tuple[list[Optional[LayerKeys]], dict]]:
    """The remembered (per-layer formats, report) for `key`, from the cache root, else the shared
    folder, else the choices the package ships (either then copied into the root), or None. `scale_shapes`: per layer, None where no format may
    be (no 4-bit keys), else the shape of its scaled keys' scales, (n_kv_heads, 1, head_dim)."""
    own = Path(root) / CHOICES_DIR
    got = _load_from(own, key, scale_shapes)
    if got is not None:
        return got
    shared = shared_dir()
    folders = [shared] if shared is not None and shared.resolve() != own.resolve() else []
    if os.environ.get(SHIPPED_ENV, "on").strip().lower() not in ("", "0", "off", "none"):
        folders.append(SHIPPED_DIR)
    for folder in folders:
        got = _load_from(folder, key, scale_shapes)
        if got is not None:
            formats, report = got
            report = {k: v for k, v in report.items() if k != "remembered"}
            _save_into(own, key, formats, report, ROOT_KEEP)
            return formats, {**report, "remembered": got[1]["remembered"]}
    return None


def _load_from(folder: Path, key: str,
               scale_shapes: Sequence[Optional[tuple[int, ...]]]) -> Optional[tuple[list[Optional[LayerKeys]], dict]]:
    path = folder / f"{key}.json"
    try:
        data = json.loads(read_capped(path, MAX_FILE_BYTES))  # never a FIFO or symlink
        if data.get("key") != key or len(data["layers"]) != len(scale_shapes):
            raise ValueError("written for another model or calibration")
        formats = [_decode(d, shape) for d, shape in zip(data["layers"], scale_shapes)]
        report = dict(data["report"])
    except FileNotFoundError:
        return None
    except (OSError, BadFile, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("persist_q4: ignoring the remembered key format %s (%s); calibrating again", path, e)
        return None
    report["remembered"] = str(path)
    return formats, report


def save(root: Path, key: str, formats: Sequence[Optional[LayerKeys]], report: dict) -> None:
    """Remember a calibration's choice in the cache root and the shared folder (atomically: a reader
    sees the old file, the new one or none). Never raises: a choice not written is calibrated again
    at the next start."""
    folder = Path(root) / CHOICES_DIR
    _save_into(folder, key, formats, report, ROOT_KEEP)
    shared = shared_dir()
    if shared is not None and shared.resolve() != folder.resolve():
        _save_into(shared, key, formats, report, SHARED_KEEP, shared=True)


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the `keep` newest choices (others may be pruning beside us: a vanished file
    is skipped)."""
    dated = []
    for path in folder.glob("*.json"):
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, old in sorted(dated, reverse=True)[keep:]:
        try:
            old.unlink()
        except OSError:
            pass


def _save_into(folder: Path, key: str, formats: Sequence[Optional[LayerKeys]], report: dict,
               keep: int, shared: bool = False) -> None:
    tmp = None
    try:
        folder.mkdir(mode=0o700, parents=shared, exist_ok=True)
        for stale in folder.glob(".tmp-*"):  # a save cut short by a crash (one server per root: none is live)
            if not shared or time.time() - stale.stat().st_mtime > 3600:  # shared: another server may be writing
                stale.unlink(missing_ok=True)
        data = {"key": key, "version": VERSION, "report": report, "layers": [_encode(f) for f in formats]}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, folder / f"{key}.json")
        tmp = None
        _prune(folder, keep)
    except (OSError, TypeError, ValueError) as e:
        log.warning("persist_q4: could not remember the key format in %s: %s", folder, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
