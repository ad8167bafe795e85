"""Defects injected by hand, one at a time, into a temporary copy of the package: does the pool's state
machine (vllm_mlx_persist/tools/reliability/pool_machine.py) catch each, and how fast?

    python tests/mutants.py [--only NAME,...] [--hunt-seconds S] [--hunt-seed N]    (from the repository root)

Per defect: the package is copied to a temporary directory with the defect applied as a text edit
(the working tree is never touched), then
- suite: tests/test_state_machine.py as CI runs it (its short seeded runs and the replayed examples),
  stopped at the first failure, unshrunk (POOL_MACHINE_SHRINK=0): caught or not, and the seconds to it;
- hunt (only when the suite missed it, with --hunt-seconds > 0): the campaign's way (a new seed every
  10 examples of up to 50 steps, every fourth seed with the fleet rules, seeds from --hunt-seed on, not
  the suite's) until a failure or the time is up.
Prints a markdown table (docs/reliability.md, "The state machine's reference model"). `--rules`: each of
RULE_MUTANTS against the test written to catch it. A harness for the test suite, run by hand: no
`vllm-mlx-persist` command runs it, and the wheel does not carry it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # tests/ is at the repository root


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str  # relative to the repository
    edits: tuple[tuple[str, str], ...]  # (old, new): old must occur exactly once
    what: str
    test: str = ""  # RULE_MUTANTS: the test (file::name) written to catch it


MUTANTS = (
    Mutant("pinned_evicted", "pool", "vllm_mlx_persist/agents.py",
           (("agent.hot_bytes and not agent.pinned", "agent.hot_bytes"),),
           "the hot budget evicts pinned agents too"),
    Mutant("lru_fifo", "pool", "vllm_mlx_persist/agents.py",
           (("            entries.move_to_end(agent.namespace)", "            pass"),),
           "a use does not move the agent to the LRU's recent end (eviction in first-made order)"),
    Mutant("lru_reversed", "pool", "vllm_mlx_persist/agents.py",
           (("            for agent in self.registry.values():", "            for agent in reversed(self.registry.values()):"),),
           "the hot tier evicts the most recently used agent first"),
    Mutant("erase_in_flight_stored", "pool", "vllm_mlx_persist/records.py",
           (("                    entry[1] = True", "                    pass"),),
           "an erasure does not stop a request of the agent in flight from storing its turn"),
    Mutant("manifest_before_blocks", "persister", "vllm_mlx_persist/persister.py",
           (("            sizes = {}\n            for b in blocks:",
             "            sizes = {}\n            if not superseded:\n                manifest_size = self.store.write_manifest(manifest)\n"
             "            for b in blocks:"),
            ("            if not superseded:\n                manifest_size = self.store.write_manifest(manifest)\n        except OSError",
             "        except OSError")),
           "a save writes the manifest before its blocks"),
    Mutant("erase_keeps_retrying_save", "persister", "vllm_mlx_persist/persister.py",
           (("and (before is None or j.order < before)]", "and (before is None or j.order < before) and not j.attempts]"),),
           "an erasure leaves the agent's save still queued for a retry (it brings the agent back)"),
    Mutant("erase_drops_later_saves", "persister", "vllm_mlx_persist/persister.py",
           (("and (before is None or j.order < before)]", "]"),),
           "an erasure drops the agent's saves queued after it too (a turn of the agent made anew is lost)"),
    Mutant("erase_leaves_retry_blocks", "persister", "vllm_mlx_persist/persister.py",
           (("            gone += [b for b in self._unkept(stale) if b not in gone]\n", ""),),
           "an erasure dropping a save queued for a retry leaves the blocks only that save wrote"),
    Mutant("budget_erases_queued", "persister", "vllm_mlx_persist/disk_index.py",
           (("busy = self.live.keys() | self.queued_agents.keys()", "busy = self.live.keys()"),),
           "the disk budget may erase an agent whose save is still queued"),
    Mutant("ttl_erases_pinned", "persister", "vllm_mlx_persist/disk_index.py",
           (("a.last_used < cutoff and not a.pinned", "a.last_used < cutoff"),),
           "the TTL erases pinned agents too"),
    Mutant("failed_save_acked", "persister", "vllm_mlx_persist/persister.py",
           (("                job.future.set_result(False)  # the caller goes on",
             "                job.future.set_result(True)  # the caller goes on"),),
           "a failed save is acknowledged as durable"),
    Mutant("lookup_one_past", "lookup", "vllm_mlx_persist/lookup.py",
           (("n = min(lcp(got.tokens, prompt[covered : covered + len(got.tokens)]), limit - covered)",
             "n = min(lcp(got.tokens, prompt[covered : covered + len(got.tokens)]) + 1, len(got.tokens), "
             "limit - covered)"),),
           "a lookup serves one token past where the prompt and the block differ"),
    Mutant("forget_keeps_superseded", "lookup", "vllm_mlx_persist/kv_edit/supersede.py",
           (("    return [br for br in branches if not any(b in block_ids for b in br.block_ids)]",
             "    return list(branches)"),),
           "a forget edit keeps the branches it superseded (they may be served again)"),
    Mutant("commit_tail_unsaved", "commit", "vllm_mlx_persist/commit.py",
           (("and b.block_id in built.datas]", "and b.block_id in built.datas][:-1]"),),
           "a turn's save leaves out its last new block (the manifest names a block never written)"),
    Mutant("text_match_prefix", "text matching", "vllm_mlx_persist/text_match.py",
           (('        if ts == tp and not ts.endswith("\\ufffd"):', '        if tp.startswith(ts) and not ts.endswith("\\ufffd"):'),),
           "re-tokenized text counts as matched when the stored text is only a prefix of the prompt's"),
)


# Defects of the fleet's merge rules and of the disk budget that the whole suite once missed (issue #44),
# each with the test written to catch it (`--rules` runs those tests against each).
RULE_MUTANTS = (
    Mutant("removal_older_wins", "merge", "vllm_mlx_persist/chain.py",
           (("if r.at >= since and (r.block not in by_block or by_block[r.block].at < r.at):",
             "if r.at >= since and (r.block not in by_block or by_block[r.block].at > r.at):"),),
           "of two removal records of one block the older one wins",
           "tests/test_merge_rules.py::test_two_removal_records_of_one_block_keep_the_newer"),
    Mutant("sync_ignores_cleared", "merge", "vllm_mlx_persist/fleet_view.py",
           (("branches, removals, cleared, floor = merge_records(branches, mine, fetched, MAX_REMOVALS,",
             "branches, removals, cleared, floor = merge_records(branches, mine, Copy(fetched.branches, "
             "fetched.removals, removed_floor=fetched.removed_floor), MAX_REMOVALS,"),),
           "a fetched copy's spliced_cleared ignored by the sync's merge",
           "tests/test_merge_rules.py::test_the_sync_merge_applies_a_fetched_copys_spliced_cleared"),
    Mutant("put_own_removals_only", "merge", "vllm_mlx_persist/fleet/manifests.py",
           (("merge_records(new, copy_of(m), copy_of(theirs), MAX_REMOVALS, 0.0, given.get)",
             "merge_records(new, copy_of(m), Copy(copy_of(theirs).branches), MAX_REMOVALS, 0.0, given.get)"),),
           "a put's merge applies its own removal records, not those Redis holds",
           "tests/test_merge_rules.py::test_a_puts_merge_applies_the_removal_records_redis_holds"),
    # issue #53: the floor, the settings merge and the stamps of settings
    Mutant("sync_ignores_local_floor", "merge", "vllm_mlx_persist/fleet_view.py",
           (("mine = Copy(tuple(agent.branches), agent.removals, agent.spliced_cleared, removed_floor=agent.removed_floor)",
             "mine = Copy(tuple(agent.branches), agent.removals, agent.spliced_cleared)"),),
           "a sync's merge ignores the local record's removed_floor",
           "tests/test_merge_rules.py::test_the_sync_merge_applies_the_local_records_floor"),
    Mutant("put_takes_put_pin", "merge", "vllm_mlx_persist/fleet/manifests.py",
           (('return manifest_of(m.namespace, new, values["pinned"], max(',
             'return manifest_of(m.namespace, new, m.pinned, max('),),
           "a put's merge takes the put's pin instead of the merged one",
           "tests/test_merge_rules.py::test_a_puts_merge_keeps_the_merged_pin"),
    Mutant("differ_values_only", "merge", "vllm_mlx_persist/record_settings.py",
           (("and (values[name] != theirs[name] or times.get(name) != theirs_at.get(name))",
             "and (values[name] != theirs[name])"),),
           "record_settings.differ compares values and not their stamps",
           "tests/test_merge_rules.py::test_a_setting_set_again_to_its_value_is_published_with_its_new_time"),
    Mutant("load_drops_settings_at", "record", "vllm_mlx_persist/records.py",
           (("settings_at=dict(m.settings_at or {}), removed_floor", "removed_floor"),),
           "Records.load drops settings_at",
           "tests/test_merge_rules.py::test_an_agents_setting_times_survive_a_restart"),
    Mutant("floor_by_last_used", "merge", "vllm_mlx_persist/chain.py",
           (("return [br for br in branches if br.written > floor", "return [br for br in branches if br.last_used > floor"),),
           "chain.above_floor compares last_used instead of written",
           "tests/test_merge_rules.py::test_the_floor_compares_when_content_was_written_not_used"),
    Mutant("setting_on_raw_clock", "record", "vllm_mlx_persist/records.py",
           (('"forkable": core.agents.later(agent)}', '"forkable": core.clock()}'),),
           "a fork setting is stamped with the raw clock (one stepped back loses to the setting it overrides)",
           "tests/test_merge_rules.py::test_settings_are_stamped_after_the_records_stamps"),
    Mutant("disk_touch_not_recency", "persister", "vllm_mlx_persist/disk_index.py",
           (("            agent.last_used = now\n            self.agents.move_to_end(namespace)",
             "            agent.last_used = now"),),
           "a use does not refresh the disk index's recency (the budget erases in save order)",
           "tests/test_merge_rules.py::test_a_use_refreshes_an_agents_disk_recency"),
    Mutant("budget_newest_dir_first", "persister", "vllm_mlx_persist/cache_root.py",
           (("return sorted(out, key=lambda t: t[2])", "return sorted(out, key=lambda t: -t[2])"),),
           "the budget removes the newest of other models' directories first",
           "tests/test_merge_rules.py::test_the_budget_removes_the_oldest_of_other_models_directories_first"),
    Mutant("scaled_identity_by_shape", "key formats", "vllm_mlx_persist/caches/key_formats.py",
           (("hashlib.sha256(np.array(self.scales).tobytes())", "hashlib.sha256(str(np.array(self.scales).shape).encode())"),),
           "a scaled key format's identity depends on its scales' shape, not their values",
           "tests/test_merge_rules.py::test_a_scaled_key_formats_identity_is_its_scales_values"),
    # The fleet's outbox (issue #53): pending removals durable, in order, drained and bounded.
    Mutant("outbox_drops_earlier_first", "outbox", "vllm_mlx_persist/fleet/outbox.py",
           (("        self._write(path, {\"agent\": namespace, \"era\": era, \"at\": at}, Entry(namespace, at, era=era))\n"
             "        self._drop_older(namespace, path, at, forgets_only=False)",
             "        self._drop_older(namespace, path, at, forgets_only=False)\n"
             "        self._write(path, {\"agent\": namespace, \"era\": era, \"at\": at}, Entry(namespace, at, era=era))"),),
           "an erasure's record removes the agent's earlier ones before its own is durable",
           "tests/test_fleet_partitions.py::test_a_failed_erasure_record_keeps_the_agents_earlier_one"),
    Mutant("outbox_rename_unsynced", "outbox", "vllm_mlx_persist/fleet/outbox.py",
           (("            os.write(fd, json.dumps(value, sort_keys=True).encode())\n            _fsync(fd)",
             "            os.write(fd, json.dumps(value, sort_keys=True).encode())"),),
           "an outbox file is renamed into place without an fsync",
           "tests/test_fleet_partitions.py::test_an_outbox_file_is_fsynced_before_its_rename_and_the_directory_after"),
    Mutant("outbox_times_from_zero", "outbox", "vllm_mlx_persist/fleet/outbox.py",
           (("        self._last_at = max((e.at for e in self._files.values()), default=0)",
             "        self._last_at = 0"),),
           "a restarted outbox's times start again from the clock, not from its pending entries",
           "tests/test_fleet_partitions.py::test_outbox_times_go_on_from_the_files_after_a_restart_whatever_the_clock"),
    Mutant("tombstone_before_outbox", "outbox", "vllm_mlx_persist/fleet/sync.py",
           (("        ident = secrets.token_hex(8)\n        try:\n            self.outbox.add(namespace, ident)",
             "        ident = secrets.token_hex(8)\n        self.tier.erase(namespace, ident)\n        try:\n"
             "            self.outbox.add(namespace, ident)"),),
           "the tombstone is queued before the erasure is in the outbox",
           "tests/test_fleet_partitions.py::test_the_outbox_records_an_erasure_before_its_tombstone_is_queued"),
    Mutant("erasure_let_go_early", "outbox", "vllm_mlx_persist/fleet/writer.py",
           (("            if int(self._cas_script(client, [key], [cur.raw_id, self.tombstone_ttl_s, *fields])):",
             "            if self.on_erase_done is not None:\n                self.on_erase_done(namespace, ident)\n"
             "            if int(self._cas_script(client, [key], [cur.raw_id, self.tombstone_ttl_s, *fields])):"),),
           "the writer lets an erasure go (its outbox file) before its tombstone is written",
           "tests/test_fleet_partitions.py::test_the_writer_lets_an_erasure_go_only_once_its_tombstone_is_written"),
    Mutant("forget_publish_not_recorded", "outbox", "vllm_mlx_persist/fleet/sync.py",
           (("            self._record_removal(manifest)  # before the turn is acknowledged (this runs before)\n", ""),),
           "a forget is acknowledged with no pending publish in the outbox",
           "tests/test_fleet_partitions.py::test_a_forget_acknowledged_before_a_crash_reaches_the_fleet_after_the_restart"),
    Mutant("forget_let_go_when_given_up", "outbox", "vllm_mlx_persist/fleet/writer.py",
           (("        self._state.count(\"put_failures\")\n        return False",
             "        self._state.count(\"put_failures\")\n        self._put_done(item.manifest)\n        return False"),),
           "a forget's pending publish is let go when its put is given up",
           "tests/test_fleet_partitions.py::test_a_forget_whose_put_was_given_up_reaches_redis_while_the_server_runs"),
    Mutant("outbox_read_at_start_only", "outbox", "vllm_mlx_persist/fleet/sync.py",
           (("            self._drain_wake.wait(self.settings.outbox_retry_s)", "            return"),),
           "the outbox is sent again at start-up only, not while the server runs",
           "tests/test_fleet_partitions.py::test_an_erasure_in_the_outbox_reaches_redis_while_the_server_runs"),
    Mutant("removals_past_bound_acknowledged", "outbox", "vllm_mlx_persist/fleet/outbox.py",
           (("        return len(self) >= self.bound", "        return False"),),
           "removals past the outbox's bound are acknowledged",
           "tests/test_fleet_partitions.py::test_removals_past_the_bound_are_refused_with_503_not_acknowledged"),
)


def copy_with(m: Mutant | None, dest: Path) -> Path:
    """The package, the state machine's tests and pyproject.toml under `dest` (and a rule mutant's
    test file with test_remote.py, test_pool.py and test_forget.py, whose helpers it uses), with `m`
    applied."""
    shutil.copytree(REPO / "vllm_mlx_persist", dest / "vllm_mlx_persist",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "tests").mkdir()
    extra = (m.test.split("::")[0], "tests/test_remote.py", "tests/test_pool.py",
             "tests/test_forget.py") if m is not None and m.test else ()
    for f in ("tests/conftest.py", "tests/test_state_machine.py", "pyproject.toml", *extra):
        shutil.copy(REPO / f, dest / f)
    if m is not None:
        path = dest / m.path
        text = path.read_text()
        for old, new in m.edits:
            assert text.count(old) == 1, f"{m.name}: {old!r} occurs {text.count(old)} times in {m.path}"
            text = text.replace(old, new)
        path.write_text(text)
    return dest


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(root), "POOL_MACHINE_SHRINK": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "COLUMNS": "400"}  # pytest's summary line keeps the failed invariant's message


def suite(root: Path, timeout: float) -> dict:
    """tests/test_state_machine.py in the copy, to its first failure."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            "-o", "addopts=-ra -p no:asyncio", "tests/test_state_machine.py"],
                           cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"caught": False, "seconds": round(time.monotonic() - t0, 1), "test": "timed out"}
    seconds = round(time.monotonic() - t0, 1)
    failed = re.search(r"^FAILED (\S+)(?: - (.*))?$", p.stdout, re.M)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"caught": p.returncode == 1, "seconds": seconds,
            "test": failed.group(1).split("::")[-1] if failed else "",
            "problem": (failed.group(2) or "")[:200] if failed else ""}


def rule_test(root: Path, test: str, timeout: float) -> dict:
    """A rule mutant's own test in the copy: whether it fails (catches the defect)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-o", "addopts=-ra -p no:asyncio", test], cwd=root,
                       env={**_env(root), "PYTHONPATH": f"{root}:{root / 'tests'}"},
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"caught": p.returncode == 1, "seconds": round(time.monotonic() - t0, 1)}


def hunt(seconds: float, seed: int) -> dict:
    """(In the copy's process.) The campaign's way, unshrunk, until a failure or `seconds`."""
    import logging

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as use_seed
    from hypothesis.stateful import run_state_machine_as_test

    from vllm_mlx_persist.tools.reliability.machine_campaign import EXAMPLES_PER_SEED, STEPS
    from vllm_mlx_persist.tools.serving import RedisServer
    from vllm_mlx_persist.tools.reliability.pool_machine import FleetMachine, PoolMachine

    logging.getLogger("vllm_mlx_persist").setLevel(logging.CRITICAL)
    t0, s = time.monotonic(), seed
    while time.monotonic() - t0 < seconds:
        fleet = (s - seed) % 4 == 1 and RedisServer.available()
        machine = use_seed(s)(type(f"Hunt{s}", (FleetMachine if fleet else PoolMachine,), {}))
        try:
            run_state_machine_as_test(machine, settings=settings(
                max_examples=EXAMPLES_PER_SEED, stateful_step_count=STEPS, deadline=None, database=None,
                phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
        except BaseException as e:
            return {"caught": True, "seconds": round(time.monotonic() - t0, 1), "seed": s, "fleet": fleet,
                    "problem": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
        s += 1
    return {"caught": False, "seconds": round(time.monotonic() - t0, 1), "seeds": s - seed}


def hunt_in(root: Path, seconds: float, seed: int) -> dict:
    """hunt() in a process of its own that imports the copy's package (PYTHONPATH: the copy)."""
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--hunt-here", str(seconds),
                        "--hunt-seed", str(seed)], cwd=root, env=_env(root), capture_output=True, text=True,
                       timeout=seconds + 300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"hunt exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated names (default: all; 'none': no defect, the control)")
    ap.add_argument("--suite-timeout", type=float, default=600.0)
    ap.add_argument("--hunt-seconds", type=float, default=0.0, help="campaign-style search when the suite misses")
    ap.add_argument("--hunt-seed", type=int, default=1000)
    ap.add_argument("--hunt-here", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--rules", action="store_true", help="RULE_MUTANTS against their own tests (and the control)")
    args = ap.parse_args(argv)
    if args.rules:
        print("| defect | what | its test | with the defect | without |")
        print("|---|---|---|---|---|", flush=True)
        for m in RULE_MUTANTS:
            if args.only and m.name not in args.only.split(","):
                continue
            got = {}
            for label, applied in (("with", m), ("without", None)):
                with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
                    root = copy_with(m, Path(tmp))
                    if applied is None:  # the control: the same copy without the edit
                        shutil.rmtree(root / "vllm_mlx_persist")
                        shutil.copytree(REPO / "vllm_mlx_persist", root / "vllm_mlx_persist",
                                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                    got[label] = rule_test(root, m.test, args.suite_timeout)
            print(f"| {m.name} | {m.what} | {m.test.split('::')[-1]} | "
                  f"{'fails (caught)' if got['with']['caught'] else 'PASSES (missed)'} | "
                  f"{'fails' if got['without']['caught'] else 'passes'} |", flush=True)
        return 0
    if args.hunt_here is not None:
        print(json.dumps(hunt(args.hunt_here, args.hunt_seed)), flush=True)
        return 0
    wanted = [n for n in args.only.split(",") if n]
    todo: list = [m for m in MUTANTS if not wanted or m.name in wanted]
    if "none" in wanted:
        todo.insert(0, None)
    results = []
    print("| defect | area | what | suite | suite s | failing test | campaign | campaign s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for m in todo:
        with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
            root = copy_with(m, Path(tmp))
            got = {"suite": suite(root, args.suite_timeout)}
            if not got["suite"]["caught"] and args.hunt_seconds > 0 and m is not None:
                got["hunt"] = hunt_in(root, args.hunt_seconds, args.hunt_seed)
        name, area, what = (m.name, m.area, m.what) if m is not None else ("none", "-", "no defect (control)")
        s, h = got["suite"], got.get("hunt")
        camp = "-" if h is None else ("caught" if h["caught"] else "missed")
        camp_s = "-" if h is None else (f"{h['seconds']}" + (f" (seed {h['seed']})" if h["caught"] else ""))
        print(f"| {name} | {area} | {what} | {'caught' if s['caught'] else 'missed'} | {s['seconds']} | "
              f"{s['test'] or '-'} | {camp} | {camp_s} |", flush=True)
        results.append({"name": name, **got})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
