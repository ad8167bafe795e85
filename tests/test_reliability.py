"""The quick reliability campaigns find nothing: the store ones (real store, real SIGKILLs, real mutated
files) and the server ones (a real `vllm-mlx serve` SIGKILLed, on a full or failing disk, soaked and
stormed). Any lost turn, corrupt serve, crash, hang or budget overrun is a campaign failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def run_quick(tmp_path: Path, campaigns: str) -> dict:
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "reliability", "--quick", "--campaigns", campaigns,
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "reliability.json").read_text())
    failures = {n: c["failure_cases"] for n, c in results["campaigns"].items() if c["failures"]}
    assert r.returncode == 0 and not failures, (failures, r.stdout, r.stderr[-3000:])
    return results["campaigns"]


def test_quick_store_campaigns_pass_and_write_the_report(tmp_path):
    results = run_quick(tmp_path, "crash,fuzz")
    crash, fuzz = results["crash"], results["fuzz"]
    assert crash["trials"] >= 50 and crash["acked_turns"] > 0, crash
    assert set(crash["points"]) == {"open", "write", "fsync", "rename", "dirsync"}, crash
    assert fuzz["trials"] >= 60
    seen = {m.split(":")[0] for m in fuzz["outcomes"]}
    assert seen == {"block", "manifest", "model"}
    assert all("served-bad" not in o and "crash" not in o and "hang" not in o for o in fuzz["outcomes"].values())
    assert fuzz["outcomes"]["block:forged_tokens"] == {"chain-refused": sum(fuzz["outcomes"]["block:forged_tokens"].values())}
    assert "| crash | " in (tmp_path / "reliability.md").read_text()


def test_quick_server_campaigns_pass(tmp_path):
    results = run_quick(tmp_path, "server_crash,disk,storm,soak")
    crash = results["server_crash"]
    assert {"mid-request", "after-response", "write-point"} <= set(crash["modes"]), crash
    assert crash["turns_checked_across_a_kill"] > 0 and crash["replies_compared"] > 0, crash
    disk = results["disk"]
    full = disk["phases"]["full"]
    assert full["requests_ok"] > 0 and (full["write_errors"] or full["save_failures"]), disk
    assert disk["phases"]["eio-read"]["read_errors"] > 0 and disk["phases"]["read-recovered"]["hits_disk"] > 0
    storm = results["storm"]
    assert {"turn", "abort", "disconnect", "bad_body", "bad_id"} <= set(storm["requests"]), storm
    assert storm["agents_verified_after"] > 0
    soak = results["soak"]
    assert soak["trials"] > 0 and soak["latency"], soak
    md = (tmp_path / "reliability.md").read_text()
    assert all(f"## {n}" in md for n in ("server_crash", "disk", "storm", "soak"))


@pytest.fixture(scope="module")
def interactions(tmp_path_factory) -> dict:
    """One quick interactions campaign (about two minutes), shared by the tests below."""
    out = tmp_path_factory.mktemp("interactions")
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "reliability", "--quick", "--campaigns", "interactions",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    results = json.loads((out / "reliability.json").read_text())
    return {"rc": r.returncode, "log": r.stdout + r.stderr[-3000:], "md": (out / "reliability.md").read_text(),
            **results["campaigns"]["interactions"]}


def test_quick_interactions_campaign_mixes_the_operations_and_checks_them(interactions):
    """The campaign itself works: every kind of step ran, answers and acknowledged turns were checked
    (across restarts too), the watchers sampled, and each failure carries its reproduction."""
    c = interactions
    assert c["trials"] == 100 and not any("campaign raised" in f["problem"] for f in c["failure_cases"]), c["log"]
    assert {"turn", "concurrent", "fork", "branch", "erase", "pin", "kill"} <= set(c["ops"]), c["ops"]
    assert {"kill-mid", "write-point"} & set(c["ops"]), c["ops"]
    assert c["replies_compared"] >= 80 and c["turns_checked"] > 0 and c["turns_checked_across_a_restart"] > 0
    assert c["fork_first_checked"] > 0 and c["erasures_requested"] > 0 and c["erased_revisited"] > 0
    assert c["health_polls"] > 0 and c["hot_bytes_peak"] > 0 and c["disk_peak_bytes"] > 0
    for f in c["failure_cases"]:
        assert f["seed"] == 12 and f["kind"] and f["steps"] and f["problem"], f
    assert "## interactions" in c["md"] and "| interactions | 100 |" in c["md"]


def test_quick_interactions_campaign_finds_nothing(interactions):
    assert interactions["rc"] == 0 and interactions["failures"] == 0, interactions["failure_kinds"]
