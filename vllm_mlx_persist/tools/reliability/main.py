"""Reliability campaigns against the real store: crash points and fuzzed files.

    vllm-mlx-persist reliability [--quick] [--campaigns crash,fuzz] [--out docs]

crash: a subprocess runs the real DiskStore writing agents' blocks and manifests (printing an ACK
once a turn's manifest is durable) and is SIGKILLed at a random moment; the store is then reopened
as a server start does (open, gc) and checked: every acknowledged turn is fully readable, every file
there reads back exactly, no temp file and no unreferenced block survives the start.

fuzz: a store of agents built with the pool's chained block ids gets one mutation per trial (bit
flips, truncation, forged tokens with a recomputed checksum, swapped blocks, foreign manifests,
links, FIFOs, directories, huge or negative numbers, invalid or deeply nested JSON) and is reopened
and read as the pool reads it; each outcome is classified quarantined / ignored / refused, and any
crash, hang or damaged or foreign KV served is a failure.

The campaigns against a real server (server_crash, disk, storm, soak, interactions) and the pool's state
machine (state_machine, fleet) are in their own modules; campaigns.py lists them all.

Figures, the command and the machine go to <out>/reliability.md and <out>/reliability.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .campaigns import CAMPAIGNS, PROGRESS
from .report import merged, write_report


def _machine() -> str:
    from ..serving import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"



def _trials_arg(text: str) -> dict[str, int]:
    """`--trials`: "N" (every campaign) or "name=N,name=N" -> {name or "*": N}."""
    try:
        if "=" not in text:
            return {"*": int(text)}
        pairs = (part.split("=", 1) for part in text.split(",") if part.strip())
        return {name.strip(): int(n) for name, n in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or NAME=N,...: {text!r}") from None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="vllm-mlx-persist reliability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about a minute: fewer trials per campaign")
    p.add_argument("--campaigns", default=",".join(CAMPAIGNS), help=f"comma-separated, of {sorted(CAMPAIGNS)}")
    p.add_argument("--trials", type=_trials_arg, default={},
                   help="trials per campaign, overriding --quick: N for every campaign, or NAME=N,... for some")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--out", default="docs", help="directory for reliability.md and reliability.json")
    p.add_argument("--work", help="scratch directory (default: a temporary one)")
    p.add_argument("--progress-steps", type=int, default=250, metavar="N",
                   help="interactions: write the report with the figures so far every N steps (default 250)")
    args = p.parse_args(argv)
    # Quarantines are expected by the thousand here; the campaigns count them.
    logging.getLogger("vllm_mlx_persist.store").setLevel(logging.ERROR)
    names = [n.strip() for n in args.campaigns.split(",") if n.strip()]
    unknown = (set(names) | set(args.trials) - {"*"}) - set(CAMPAIGNS)
    if unknown:
        p.error(f"unknown campaign(s) {sorted(unknown)}; known: {sorted(CAMPAIGNS)}")
    results: dict[str, Any] = {"machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": "vllm-mlx-persist reliability " + " ".join(argv), "campaigns": {}}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vllm-mlx-persist-reliability-"))
    # SIGTERM as Ctrl-C: the campaign in progress stops its servers (no orphans) and keeps its figures.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def record(name: str, r: dict, t0: float, quick: bool) -> None:
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["run"] = {"command": results["command"], "date": results["date"], "quick": quick,
                    "machine": results["machine"]}
        results["campaigns"][name] = r
        # after every campaign (and a long one's progress), so a run stopped later keeps its figures
        write_report(merged(results, Path(args.out) / "reliability.json"), Path(args.out), results["command"])

    try:
        for name in names:
            fn, full, quick = CAMPAIGNS[name]
            trials = args.trials.get(name) or args.trials.get("*") or (quick if args.quick else full)
            is_quick = bool(args.quick and trials == quick)
            t0 = time.perf_counter()
            kw = {"progress": lambda r, name=name, t0=t0: record(name, r, t0, is_quick),
                  "every": args.progress_steps} if name in PROGRESS else {}
            try:
                r = fn(trials, args.seed, work, **kw)
            except Exception:  # a campaign that cannot finish is a failure, with its reason
                import traceback

                done = results["campaigns"].get(name, {}).get("trials", 0) if name in PROGRESS else trials
                r = {"trials": done, "failures": 1, "failure_cases": [  # trials: those reported done, if any
                    {"seed": args.seed, "problem": f"campaign raised: {traceback.format_exc()[-1500:]}"}]}
            record(name, r, t0, is_quick)
            print(f"{name}: {r['trials']} trials, {r['failures']} failures, {r['seconds']} s"
                  + (" (stopped before the end)" if r.get("stopped_before_final_check") else ""), flush=True)
            for case in r.get("failure_cases", []):
                print(f"  {name} failure: {json.dumps(case)[:600]}", flush=True)
            if r.get("stopped_before_final_check"):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("stopped: the report keeps the figures of what ran", flush=True)
        return 130
    finally:
        if any(n in names for n in ("server_crash", "disk", "storm", "soak", "interactions")):
            from .server_kit import close_shared

            close_shared()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["failures"] for r in results["campaigns"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
