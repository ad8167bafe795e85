"""`vllm-mlx-persist calibrate MODEL_DIR`: run a `key_format` option's calibration once, exactly as the
server's first start would (the same backend code, on a throw-away cache root), and remember its choice.

Without --ship the choice goes to the user's shared `key-formats/` folder (key_choice.shared_dir), so
every later server of that model starts without calibrating. With --ship it is written into the package
(key_choice.SHIPPED_DIR): the project ships the choices of its real checkpoints as `make-model` imports
them, so that a newcomer's first `./dev serve` does not calibrate for minutes on a CPU (issue #50).
Prints the chosen format, what auto measured and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ... import key_choice


def calibrate(model_dir: Path, option: str = "auto", ship: bool = False) -> tuple[dict[str, Any], Optional[Path]]:
    """Resolve `option` on the model in `model_dir` as a server would; return its report and, with
    `ship`, the file written into the package."""
    from mlx_lm import load

    from ...backend import PersistQ4Backend

    model, tokenizer = load(str(model_dir))
    saved_env = os.environ.get(key_choice.SHARED_ENV)
    if ship:  # neither read from nor written to this user's shared folder
        os.environ[key_choice.SHARED_ENV] = "off"
    try:
        with tempfile.TemporaryDirectory(prefix="vmp-calibrate-") as root:
            backend = PersistQ4Backend(model=model, tokenizer=tokenizer,
                                       options={"cache_dir": root, "key_format": option})
            try:
                backend._resolve_keys()
            finally:
                backend.close()
            report = dict(backend.key_report or {})
            if "error" in report:
                raise RuntimeError(report["error"])
            written = None
            if ship:
                files = sorted(Path(root, key_choice.CHOICES_DIR).glob("*.json"))
                if len(files) != 1:
                    raise RuntimeError(f"expected one choice file in the calibration's root, found {len(files)}")
                # Named for the import folder it was made from (./dev's: smollm2-135m-instruct,
                # gemma3-270m), so a stale file of the same checkpoint is replaced, not kept beside.
                data = json.loads(files[0].read_text())
                data["report"]["shipped_for"] = Path(model_dir).name
                key_choice.SHIPPED_DIR.mkdir(exist_ok=True)
                for old in key_choice.SHIPPED_DIR.glob("*.json"):
                    if _shipped_for(old) == Path(model_dir).name:
                        old.unlink()
                written = key_choice.SHIPPED_DIR / files[0].name
                written.write_text(json.dumps(data))
            return report, written
    finally:
        if ship:
            if saved_env is None:
                os.environ.pop(key_choice.SHARED_ENV, None)
            else:
                os.environ[key_choice.SHARED_ENV] = saved_env


def _shipped_for(path: Path) -> Optional[str]:
    try:
        return json.loads(path.read_text())["report"].get("shipped_for")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--key-format", default="auto", help="the option to calibrate (auto, scaled, k5v4c, k6v4c, k56v4c)")
    p.add_argument("--ship", action="store_true", help="write the choice into the package (the project's real "
                   "checkpoints), not the user's shared folder")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        report, written = calibrate(a.model_dir, a.key_format, a.ship)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"vllm-mlx-persist calibrate: {e}", file=sys.stderr)
        return 2
    from ...key_calibration import describe

    print(describe(report))
    print(f"{time.perf_counter() - t0:.1f} s in all (model load included); "
          + (f"shipped as {written}" if written else
             f"remembered in {key_choice.shared_dir() or 'the cache root only (shared folder off)'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
