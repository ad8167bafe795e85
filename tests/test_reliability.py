"""The quick reliability campaigns (real store, real SIGKILLs, real mutated files) find nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_quick_campaigns_pass_and_write_the_report(tmp_path):
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "reliability", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    results = json.loads((tmp_path / "reliability.json").read_text())
    crash, fuzz = results["campaigns"]["crash"], results["campaigns"]["fuzz"]
    assert crash["trials"] >= 50 and crash["failures"] == 0 and crash["acked_turns"] > 0, crash
    assert fuzz["trials"] >= 60 and fuzz["failures"] == 0, fuzz
    seen = {m.split(":")[0] for m in fuzz["outcomes"]}
    assert seen == {"block", "manifest", "model"}
    assert all("served-bad" not in o and "crash" not in o and "hang" not in o for o in fuzz["outcomes"].values())
    assert fuzz["outcomes"]["block:forged_tokens"] == {"chain-refused": sum(fuzz["outcomes"]["block:forged_tokens"].values())}
    assert "| crash | " in (tmp_path / "reliability.md").read_text()
