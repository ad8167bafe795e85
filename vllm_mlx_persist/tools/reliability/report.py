"""The report of `vllm-mlx-persist reliability` (main.py): <out>/reliability.json and reliability.md,
each campaign's figures in its own section, merged over the report already there (a campaign run on its
own replaces only its row; the section written by hand at the end stays).
"""

from __future__ import annotations

import json
from pathlib import Path

from .campaigns import CAMPAIGNS
from .store_crash import DET_STEPS


def _report_server_crash(r: dict) -> list[str]:
    if "modes" not in r:
        return []
    return [f"Server lifetimes, each ended by one SIGKILL: {', '.join(f'{k} {v}' for k, v in sorted(r['modes'].items()))} "
            f"(write-point: the server killed itself before a chosen write step, {r['write_point_kills']} times; "
            f"final-check: one more start, no kill). Completed turns: {r['completed_turns']}, of which "
            f"{r['turns_checked_across_a_kill']} were checked after a kill (the agent's next turn's cached_tokens "
            f"cover the turn before); replies compared with a never-killed server: {r['replies_compared']}; "
            f"requests in flight at a kill (retried after the restart): {r['requests_killed_in_flight']}."]


def _report_disk(r: dict) -> list[str]:
    if "phases" not in r:
        return []
    keys = ("requests_ok", "hits_hot", "hits_disk", "misses", "write_errors", "save_failures", "retries",
            "saves_dropped", "unsaved_blocks_dropped", "read_errors", "quarantined")
    out = [f"Fault: {r['tmpfs']}; then EIO injected on fsync, then on reads (faults.py). Server restarts: "
           f"{r['restarts']}. RSS: {r['rss_baseline_mb']} MB after warm-up, peak {r['rss_peak_mb']} MB, bound "
           f"{r['rss_bound_mb']} MB (warm-up + hot_mb + stated overhead). Pool hot_bytes peak {r['hot_bytes_peak']} "
           f"against hot_mb {r['hot_budget_bytes']}, bound {r.get('hot_bound_bytes')} (hot_mb + the turn being "
           f"committed, all of it unsaved on a failing disk).", "",
           "| phase | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for phase, p in r["phases"].items():
        out.append(f"| {phase} | " + " | ".join(str(p.get(k, "")) for k in keys) + " |")
    return out


def _report_soak(r: dict) -> list[str]:
    if "tiers" not in r:
        return []
    out = [f"{r['agents']} agents over {r['clients']} clients for {r['seconds_run']} s (hot_mb {r['hot_mb']}, "
           f"disk_mb {r['disk_mb']}); requests per tier: {r['tiers']}; budget erasures {r['budget_erasures']}, "
           f"agents evicted from memory {r['evicted_agents']}. RSS after warm-up {r['rss_after_warmup_mb']} MB, "
           f"peak after {r['rss_peak_after_warmup_mb']} MB, bound {r['rss_bound_mb']} MB; growth of the resident "
           f"minimum, last third against first, {(r.get('rss_growth_mb') or {}).get('low')} MB (limit "
           f"{r.get('rss_growth_limit_mb')} MB, judged on runs of {r.get('rss_growth_min_s')} s or more); disk peak "
           f"{r['disk_peak_bytes']} bytes (budget {int(r['disk_mb'] * 2**20)} + one turn).", "",
           "| window (s) | hot p50/p90/p99 ms (n) | disk p50/p90/p99 ms (n) | miss p50/p90/p99 ms (n) |",
           "|---|---|---|---|"]
    cell = lambda d: f"{d['p50_ms']}/{d['p90_ms']}/{d['p99_ms']} ({d['n']})" if d else "-"  # noqa: E731
    for w in r["latency"]:
        out.append(f"| {w['from_s']}-{w['to_s']} | {cell(w['hot'])} | {cell(w['disk'])} | {cell(w['miss'])} |")
    return out


def _report_storm(r: dict) -> list[str]:
    if "requests" not in r:
        return []
    return [f"{r['clients']} concurrent clients for {r['seconds_run']} s; slowest request {r['slowest_request_s']} s; "
            f"agents' next turns checked against a cold server afterwards: {r['agents_verified_after']}.", "",
            "| request kind | outcomes |", "|---|---|"] + [
        f"| {k} | {', '.join(f'{o} {n}' for o, n in sorted(v.items()))} |" for k, v in sorted(r["requests"].items())]


def _report_interactions(r: dict) -> list[str]:
    if "ops" not in r:
        return []
    ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
    ends = ", ".join(f"{k} {v}" for k, v in sorted(r["lifetimes"].items()))
    longest = f", histories of up to {r['longest_history_turns']} turns" if "longest_history_turns" in r else ""
    stopped = [f"Stopped after {r['trials']} steps (by a signal, or still running when written): the figures "
               "are those of the steps done, without the final restart and check.", ""]
    out = (stopped if r.get("stopped_before_final_check") else []) + [
        f"{r['trials']} steps (seed {r.get('seed', '?')}), {r['agents']} agent ids{longest} (hot_mb {r['hot_mb']}, disk_mb {r['disk_mb']}, ttl_hours "
           f"{r['ttl_hours']}, blocks of {r['block_size']} tokens, durable writes). Steps: {ops}. Server lifetimes, by "
           f"how they ended: {ends} (write-point: the server killed itself before a chosen write step, "
           f"{r['write_point_kills']} times; requests in flight at a kill: {r['requests_killed_in_flight']}).", "",
           f"Answers: {r['answers']}, every one compared with the never-killed reference: {r['replies_compared']}"
           + (f" ({r['cold_replies_equal_to_cold_reference']} computed without a cache differed from the reference's "
              "over its cached prefix and equalled its reply without one)" if r.get(
               "cold_replies_equal_to_cold_reference") else "") + ". "
           f"Acknowledged turns checked for reuse: {r['turns_checked']} ({r['turns_checked_across_a_restart']} as an "
           f"agent's first turn after a restart; {r['losses_excused_by_erasure']} not reused because a logged erasure "
           f"removed the agent); forks' first requests checked against the parent's turn: {r['fork_first_checked']}. "
           f"Erasures requested: {r['erasures_requested']}, erased ids used again: {r['erased_revisited']}; "
           f"erasures by "
           f"the disk budget: {r['budget_erasures_logged']}, by the TTL: {r['ttl_erasures_logged']}; pins "
           f"{r['pins']}, unpins {r['unpins']}; isolation probes (another agent's history under a new id): "
           f"{r['probes']}.", "",
           f"/health: {r['health_polls']} polls, slowest {r['health_worst_s']} s, {r['health_late']} past 1 s or "
           f"failed. Pool hot_bytes peak {r['hot_bytes_peak']} (bound there {r['hot_bound_at_peak']}: hot_mb + the "
           f"largest agent's last 4 sequences + pinned agents), {r['hot_over']} samples over. Disk peak "
           f"{r['disk_peak_bytes']} bytes (bound there {r['disk_bound_at_peak']}: disk_mb + one turn per request in "
           f"flight + pinned agents), {r['disk_over']} samples over. RSS after warm-up {r['rss_after_warmup_mb']} MB, peak "
           f"{r['rss_peak_mb']} MB, bound {r['rss_bound_mb']} MB.", ""]
    if r.get("failure_kinds"):
        out += ["| failure kind | count | first step |", "|---|---|---|"]
        out += [f"| {k} | {v['count']} | {v['first_step']} |" for k, v in sorted(r["failure_kinds"].items())]
        out += ["", "The first failure of each kind, with the steps before it (`--campaigns interactions --seed S "
                "--trials N` replays the same choices; timings may differ):", ""]
        shown: set[str] = set()
        for f in r["failure_cases"]:
            if f["kind"] in shown:
                continue
            shown.add(f["kind"])
            out.append(f"- {f['kind']} at step {f['step']} ({f['op']}, seed {f['seed']}): {f['problem'][:300]}; "
                       f"steps before: {'; '.join(f['steps'])}")
        out.append("")
    return out


_WHAT = {
    "crash": "A subprocess writes agents' blocks and manifests through the real store and is SIGKILLed, half the "
             "trials before a chosen system call of a write (open, write, fsync, rename, directory fsync; the "
             "store's fault hook), half at a random moment. Then the store is reopened as a server start does: "
             "every turn acknowledged as durable must read back exactly, nothing half-written may be served, no "
             "temp file or unreferenced block may survive the start.",
    "fuzz": "One mutation per trial of a block file, manifest or model.json (bit flips, truncation, zero length, "
            "appended bytes, forged tokens with a recomputed checksum, swapped blocks, foreign manifests, symlinks "
            "to files and devices, FIFOs, directories, huge or negative numbers, invalid or deeply nested JSON); "
            "the store is reopened and read as the pool reads it. Failure: a crash, a hang, or any damaged or "
            "foreign KV served. Outcomes: quarantined, chain-refused (sound file whose tokens do not chain), "
            "ignored, refused (model directory: the server then serves from memory and says so).",
    "server_crash": "A real `vllm-mlx serve --cache-backend persist_q4` (tiny local model) with 4 agents in flight "
                    "is SIGKILLed once per lifetime: mid-request, right after a response, or by itself before a "
                    "chosen write step. Failures: a completed turn not covered by the agent's next turn's "
                    "cached_tokens, a request failing while the server is up, a reply different from a "
                    "never-killed reference server's reply to the same conversation.",
    "disk": "The cache root on an 8 MB tmpfs (disk_mb 6), filled with a file, then emptied; then EIO injected on fsync, then on "
            "reads. Failures: a failed request, a reply different from the reference, memory over its bound, no "
            "counter saying what was not cached, a cache that does not work again (across a SIGKILL) once the "
            "fault is gone, a sound file quarantined on EIO.",
    "storm": "Concurrent clients mixing agents' turns (the same agent from several clients at once), streams "
             "aborted with a TCP reset, requests hung up early, invalid bodies and agent ids. Failures: the "
             "server down, a request past its time-out (120 s), a 5xx for a bad body, a bad id not answered 400, "
             "and any agent whose next turn afterwards differs from a fresh server given the same history cold.",
    "fleet": "The state machine (below) with the fleet rules on every seed: two pools sharing a redis-server, "
             "each through its own partition proxy (tools/reliability/partition.py), the second one cut off and healed at "
             "random while both serve, erase and forget; the first one's erasures and forgets killed (-9) "
             "at each step before their publish; forget edits past the removal records' bound. Failures: "
             "those of the state machine, and an acknowledged erasure that never reaches Redis or comes back "
             "after the restart, a removal one pool holds after its first sync since the other published "
             "it (docs/fleet.md, The merge rules).",
    "state_machine": "A Hypothesis state machine (vllm_mlx_persist/tools/reliability/pool_machine.py) drives the real pool, "
                     "persister and store, and with a redis-server a second pool sharing the fleet tier, through "
                     "random sequences of turns, forks, concurrent branches of one agent, re-tokenized turns "
                     "(matching by text), forget and amortize edits (spliced branches), histories sent again after "
                     "an erasure or a forget, anonymous requests, erasures, pins, hot and disk budget changes, the "
                     "TTL (a clock moved on), restarts, crashes (writes failing with turns queued), kills just "
                     "before the Nth write step, and turns whose saves stay queued behind a held writer while an "
                     "erasure, a disk budget or a sweep runs, against a reference model of what every agent should "
                     "hold. Failures: a served prefix not from the agent's (or its explicit fork parent's) histories, "
                     "from one an erasure removed or a forget superseded, or with other K/V bytes (a splice's served "
                     "to an exact lookup), text read that the client did not send, an operation past 60 s, a broken "
                     "block-table invariant, a branch held that is none of the agent's allowed histories, an agent "
                     "evicted from memory while an unpinned one used less recently stays (the LRU order), a pinned "
                     "agent leaving memory, hot or disk bytes past their budget plus one turn and the pinned agents, "
                     "a block file no manifest names or a named block without its file, a manifest on disk of an "
                     "agent the pool does not hold, after a kill a manifest naming a block missing or unsound, an "
                     "acknowledged turn not reused after a restart, crash or kill unless an erasure the stats record "
                     "removed the agent, a pinned agent erased by the budget or the TTL, a request in flight during "
                     "its agent's erasure storing its turn, a save lost on a sound disk. Trials are examples (sequences of steps). The defects "
                     "injected by hand that this model catches are in the last section.",
    "soak": "16 agents round-robin from 4 clients with growing histories (new session past 12 turns), hot_mb "
            "and disk_mb small enough that all three tiers occur. Failures: a failed request, RSS past the "
            "post-warm-up RSS + hot_mb + 1 GB (transient buffers of concurrent prefills), growth of the resident "
            "minimum (lowest RSS of the last third against the first) past 64 MB + hot_mb on runs of 10 minutes "
            "or more, disk past disk_mb + one turn. The full run is one hour "
            "(`./dev reliability --campaigns soak`: about 62 minutes on 2 cores, a few hundred MB of memory "
            "and under 10 MB of disk; it replaces only this row).",
    "interactions": "One server under tight budgets (hot_mb 0.25: two or three agents' histories; disk_mb 4: a "
                    "dozen or so; ttl_hours 0.01) runs a random mix of steps: turns of growing histories, several agents at once, forks "
                    "(fork_from), concurrent branches of one agent, DELETE /v1/agents/ID, reuse of an erased id, pins "
                    "and unpins, another agent's history under a new id (isolation probe), anonymous requests, "
                    "SIGKILLs between steps, mid-request and at a chosen write step; one more restart at the end, "
                    "then every conversation's next turn. Failures: a reply different from a never-killed "
                    "reference server's (same conversation; an answer computed without a cache, where it differs "
                    "from the reference's over a cached prefix, must equal the reference's without one: the two "
                    "paths agree to float rounding), an acknowledged turn (or a fork parent's) not covered "
                    "by the next request's cached_tokens unless the server's log records an erasure of that agent, "
                    "an erased agent listed or served again, cached tokens for a new id, a pinned agent erased, an "
                    "agent gone after a restart with no erasure logged, a request failing or past 15 s while the "
                    "server is up, /health slower than 1 s, hot_bytes, disk or RSS past their bounds. Full run: "
                    "`./dev reliability --campaigns interactions` (700 steps, about 4 minutes on 2 cores); "
                    "`--quick`: 100 steps, under a minute; `--trials interactions=10000`: about an hour (a history, "
                    "a fork's inherited turns included, stops at 7 turns before the final check's, so the rate stays "
                    "~170-190 steps a minute). "
                    "A run of any length makes every kind of step: its last steps make those not drawn yet (erase, "
                    "then revisit). A long run's figures so far are written every 250 steps.",
}


def _report_state_machine(r: dict) -> list[str]:
    if "seeds" not in r:
        return []
    return [f"Steps: {r['steps']} on one pool, {r['fleet_steps']} with the fleet rules (a second pool sharing a "
            f"redis-server), over {len(r['seeds'])} seeds of up to {r['steps_per_example']} steps per example "
            f"(seeds {r['seeds'][0]['seed']}-{r['seeds'][-1]['seed']}; the second of every four with the fleet).", "",
            "Shrunk failures found while the campaign was built, each fixed and kept as a test: a shorter turn after a "
            "restart lost to the fleet sync (tests/test_state_machine.py), the fork + hot budget + restart hang and "
            "the others of tests/test_compose.py. Found by earlier full runs of this campaign (2026-11-25), fixed, "
            "kept as tests: an unpin that left the hot tier over hot_mb until the next request (seed 30, "
            "tests/test_compose.py), and a fork served the first token of a parent history erased through the other "
            "server, because only the child was synced before the lookup (seed 17, tests/test_state_machine.py). "
            "Found by the extended model (issue #30), fixed, kept as tests: an erasure that left the blocks only "
            "a dropped retry wrote, and a retry superseded or given up that left the blocks only it kept (tests/test_store.py), an anonymous "
            "entry shadowed by a new one of the same name (tests/test_pool.py), and an erasure that dropped "
            "the saves of its agent queued after it (tests/test_state_machine.py, tests/test_store.py)."]


_SERVER_REPORT = {"server_crash": _report_server_crash, "disk": _report_disk, "soak": _report_soak,
                  "storm": _report_storm, "interactions": _report_interactions, "state_machine": _report_state_machine,
                  "fleet": _report_state_machine}


def _notes(md: Path) -> list[str]:
    """Paragraphs written by hand between a report's Date line and its table's preamble."""
    try:
        text = md.read_text()
    except OSError:
        return []
    head, sep, _ = text.partition("Each campaign's own command")
    if not sep or "\nDate: " not in head:
        return []
    body = head.split("\nDate: ", 1)[1].split("\n", 1)[1] if "\n" in head.split("\nDate: ", 1)[1] else ""
    return [p.strip() for p in body.split("\n\n") if p.strip()]


def merged(results: dict, path: Path) -> dict:
    """`results` over the report already at `path`: campaigns not run this time keep their figures (each
    campaign carries the command, date and machine of its own run), so the soak can be run on its own.
    While the old report keeps campaigns this run did not replace, its header (command, machine, date
    and the notes under it) stays: it describes those campaigns' run."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return results
    if not isinstance(old.get("campaigns"), dict):
        return results
    campaigns = {}
    for n, c in old["campaigns"].items():
        if n in CAMPAIGNS and "run" in c:
            c["run"].setdefault("machine", old.get("machine"))
            campaigns[n] = c
    kept = set(campaigns) - set(results["campaigns"])
    campaigns.update(results["campaigns"])
    head = {}
    if kept:
        head = {k: old[k] for k in ("machine", "date", "command") if k in old}
        head["notes"] = old.get("notes") or _notes(path.with_suffix(".md"))
    return {**results, **head, "campaigns": {n: campaigns[n] for n in CAMPAIGNS if n in campaigns}}


# A section written by hand at the end of reliability.md (the state machine's injected defects,
# from tests/mutants.py): a rewrite of the report keeps it.
KEPT_SECTION = "## The state machine against injected defects"


def write_report(results: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    lines = ["# Reliability campaigns", "", f"Command: `{results.get('command', command)}`  ",
             f"Machine: {results['machine']}  ", f"Date: {results['date']}", ""]
    for note in results.get("notes") or []:
        lines += [note, ""]
    lines += ["Each campaign's own command and date are in its row (a campaign run on its own replaces only its row).",
              "", "| campaign | trials | failures | seconds | run |", "|---|---|---|---|---|"]
    for name, r in results["campaigns"].items():
        run = r.get("run", {})
        how = f"{run.get('date', '')}, `{run.get('command', command)}`" + (" (quick)" if run.get("quick") else "")
        if run.get("machine", results["machine"]) != results["machine"]:
            how += f", on {run['machine']}"
        stopped = " (stopped)" if r.get("stopped_before_final_check") else ""
        lines.append(f"| {name} | {r['trials']}{stopped} | {r['failures']} | {r['seconds']} | {how} |")
    for name, r in results["campaigns"].items():
        lines += ["", f"## {name}", "", _WHAT.get(name, ""), ""]
        if name == "crash":
            lines.append(f"Acknowledged turns: {r['acked_turns']}; temp files removed at restart: "
                         f"{r['tmp_removed']}; unreferenced blocks removed at restart: {r['orphans_removed']}; "
                         f"kills during start-up: {r['killed_before_ready']}; kills at a chosen write step "
                         f"(before the Nth open, write, fsync, rename or dir fsync, N = 1..{DET_STEPS // 5} per kind): "
                         f"{r['deterministic_trials']} ("
                         + ", ".join(f"{k} {v}" for k, v in sorted(r["points"].items())) + ").")
        if name == "fuzz":
            lines += ["| mutation | outcomes |", "|---|---|"]
            for mut, o in sorted(r["outcomes"].items()):
                lines.append(f"| {mut} | {', '.join(f'{k} {v}' for k, v in sorted(o.items()))} |")
        if name in _SERVER_REPORT:
            lines += _SERVER_REPORT[name](r)
        for f in r["failure_cases"]:
            lines.append(f"- FAILURE (reproduce with `--campaigns {name} --seed {f['seed']}`): `{json.dumps(f)[:400]}`")
    md = out / "reliability.md"
    kept = md.read_text().partition(KEPT_SECTION)[1:] if md.exists() else ("", "")
    md.write_text("\n".join(lines) + "\n" + ("\n" + "".join(kept) if kept[0] else ""))
