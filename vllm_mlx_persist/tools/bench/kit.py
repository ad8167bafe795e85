"""The parts every `vllm-mlx-persist bench` section shares: the plan, prompts of a given token length,
conversations, servers of each system (tools/serving's, with the run's --persist-options), one
streamed turn, page-cache control. No section lives here: each has its own module."""

from __future__ import annotations

import hashlib
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..serving import Server, cpu_name, openblas_path, system_flags, system_server

SYSTEMS = ("persist_q4", "vllm_default", "vllm_q4_ssd")
LABELS = {
    "persist_q4": "persist_q4",
    "vllm_default": "vllm-mlx default prefix cache",
    "vllm_q4_ssd": "vllm-mlx 4-bit + SSD tier",
}
FAMILIES = ("gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3", "deepseek_v32")
# turns of the families section: (state, turn index); the restart turn follows a SIGKILL
FAMILY_TURNS = (("cold", 1), ("hot", 2), ("hot", 3), ("restart_sigkill", 4))
STATES = ("cold", "hot", "restart_sigterm", "restart_sigkill")
MB = 2**20

# ---------------------------------------------------------------------------------------------
# Plans


@dataclass
class Plan:
    model_size: str = "bench"
    # ttft
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    reps: int = 3  # conversations per context (each gives one cold sample)
    reps_by_context: dict[int, int] = field(default_factory=lambda: {4096: 2, 8192: 1})
    hot_turns: int = 2  # hot turns per conversation after its cold turn
    restart_cycles: int = 2  # SIGTERM restarts; each gives one turn per conversation
    kill_cycles: int = 1  # SIGKILL restarts; each gives one turn for the first conversation of each context
    user_words: int = 30  # the short new user turn
    ttft_max_tokens: int = 8
    ttft_cache_mb: int = 4096  # hot_mb / --cache-memory-mb: room for every context
    ttft_systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    # agents
    agents: int = 5
    agent_tokens: int = 2048
    agent_rounds: int = 3
    agent_budget_mb: int = 32
    agent_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # batch
    batch_levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    batch_tokens: int = 512
    batch_max_tokens: int = 32
    batch_reps: int = 2
    batch_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # reload
    reload_sizes: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 8192, 16384, 32768])
    reload_reps: int = 3
    bandwidth_mb: int = 1024
    # families
    family_archs: list[str] = field(default_factory=lambda: list(FAMILIES))
    family_size: str = "small"
    family_tokens: int = 2048
    family_max_tokens: int = 8
    family_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # fanout
    fanout_levels: list[int] = field(default_factory=lambda: [1, 4, 8])
    fanout_tokens: int = 4096  # the coordinator's document, in template tokens
    fanout_question_words: int = 20
    fanout_max_tokens: int = 8
    fanout_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    fanout_nofork: bool = False  # also persist_q4 without fork_from (each worker prefills the document)
    # fleet
    fleet_contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    fleet_reps: int = 2
    # long: 16k and 32k contexts on a smaller model (the bench model would take hours cold)
    long_size: str = "small"
    long_contexts: list[int] = field(default_factory=lambda: [16384, 32768])
    long_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # concurrency: two agents at once against one alone, and staggered arrivals
    conc_contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    conc_max_tokens: int = 64
    conc_stagger_s: float = 2.0
    conc_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # stall: other agents' decoding while one agent's long first turn is prefilled and written
    stall_tokens: int = 4096
    stall_agents: int = 3
    stall_history: int = 512
    stall_max_tokens: int = 32
    stall_after_s: float = 5.0
    stall_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # capacity: agents per memory budget, published shapes (analytical) and scaled-down models (measured)
    capacity_archs: list[str] = field(default_factory=lambda: ["llama", "gemma3_text", "gpt_oss", "qwen3_next",
                                                               "deepseek_v3"])
    capacity_contexts: list[int] = field(default_factory=lambda: [4096, 16384, 32768])  # published scale
    capacity_scale: int = 8  # measured: windows, block size and contexts divided by this
    capacity_turns: int = 8  # the grown agent's turns
    capacity_budgets_gib: list[int] = field(default_factory=lambda: [16, 64])
    capacity_size: str = "tiny"
    capacity_max_tokens: int = 8
    capacity_systems: list[str] = field(default_factory=lambda: ["persist_q4", "vllm_default"])
    # edits (edits.py): span directives. Re-prefill accounting over the whole grid (no model
    # forward); TTFT on real servers over a subset (histories x positions at one span and one edit, a
    # span sweep and a 1..n edits sweep at the largest history); a multi-turn truncation trace
    edit_size: str = "small"
    edit_grid_histories: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    edit_positions: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    edit_spans: list[int] = field(default_factory=lambda: [64, 256, 1024, 2048])
    edit_counts: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    edit_histories: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])  # TTFT
    edit_span: int = 256  # TTFT: the span of the histories x positions points
    edit_sweep_history: int = 4096  # TTFT: the history of the span and count sweeps
    edit_sweep_position: float = 0.1  # TTFT: where they edit
    edit_full_grid: bool = False  # TTFT over the whole accounting grid instead of the subset
    edit_trace_turns: int = 8
    edit_trace_tool_tokens: int = 1024
    edit_max_tokens: int = 4
    edit_systems: list[str] = field(default_factory=lambda: ["amortize", "forget", "exact", "vllm_default",
                                                             "no_cache"])
    # the parts of the section; "agent": the agent trace through the openai and anthropic clients
    edit_parts: list[str] = field(default_factory=lambda: ["accounting", "ttft", "trace", "agent"])
    edit_agent_turns: int = 10
    edit_agent_calls: int = 2  # tool calls per turn
    edit_agent_tool_tokens: int = 400
    edit_agent_stub_chars: int = 200  # the policy's head/tail stub
    edit_agent_apis: list[str] = field(default_factory=lambda: ["openai", "anthropic"])

    def reps_for(self, context: int) -> int:
        return self.reps_by_context.get(context, self.reps)


QUICK = Plan(
    model_size="tiny", contexts=[128, 256, 512], reps=1, reps_by_context={}, hot_turns=1,
    restart_cycles=1, kill_cycles=1, user_words=12, ttft_max_tokens=4, ttft_cache_mb=256,
    agents=3, agent_tokens=2048, agent_rounds=2, agent_budget_mb=1,
    batch_levels=[1, 2, 4], batch_tokens=128, batch_max_tokens=16, batch_reps=1,
    reload_sizes=[256, 1024, 4096], reload_reps=1, bandwidth_mb=64,
    family_archs=list(FAMILIES[:5]), family_size="tiny", family_tokens=256, family_max_tokens=4,
    fanout_tokens=512, fleet_contexts=[256, 512], fleet_reps=1,
    long_size="tiny", long_contexts=[1024, 2048], conc_contexts=[256], conc_max_tokens=16, stall_tokens=1024,
    stall_agents=2, stall_history=128, stall_max_tokens=16, stall_after_s=2.0,
    capacity_contexts=[4096], capacity_turns=2,
    edit_size="tiny", edit_grid_histories=[1024, 2048], edit_spans=[64, 256], edit_counts=[1, 2],
    edit_histories=[512, 1024], edit_span=64, edit_sweep_history=1024, edit_trace_turns=4, edit_trace_tool_tokens=128,
    edit_agent_turns=4, edit_agent_tool_tokens=96,
)

# ---------------------------------------------------------------------------------------------
# Small helpers

_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: Optional[float], nd: int = 3) -> str:
    """`x` with `nd` decimals for a table, "–" for none."""
    return "–" if x is None else f"{x:.{nd}f}"


def seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(dist)
    except PackageNotFoundError:
        return None


def machine_info(work: Path) -> dict:
    import psutil

    blas = openblas_path()
    try:
        df = subprocess.run(["df", "-hT", str(work)], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        df = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_backend": version("mlx-cpu") and f"mlx-cpu {version('mlx-cpu')}" or version("mlx-metal") and "metal",
        "mlx_lm": version("mlx-lm"),
        "vllm_mlx": version("vllm-mlx"),
        "vllm_mlx_persist": version("vllm-mlx-persist"),
        "git_commit": commit,
        "blas": (f"OpenBLAS preloaded into every server (LD_PRELOAD={blas} -> {os.path.realpath(blas)})"
                 if blas else ("Accelerate/Metal (macOS)" if platform.system() == "Darwin"
                               else "mlx-cpu's bundled reference BLAS (OpenBLAS not found: 15-35x slower)")),
        "disk": df,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# ---------------------------------------------------------------------------------------------
# Page cache


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return out


def drop_page_cache(paths: list[Path]) -> dict:
    """fsync then posix_fadvise(DONTNEED) every file under `paths`; reports how much stayed resident."""
    files = _files(paths)
    total = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            total += os.fstat(fd).st_size
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
            except OSError:
                pass
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"files": len(files), "bytes": total, "resident_after": resident_fraction(files)}


def resident_fraction(files: list[Path]) -> Optional[float]:
    """Fraction of the files' pages in the page cache (mincore; Linux only, else None)."""
    if platform.system() != "Linux" or not files:
        return None
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = pages = 0
    for f in files:
        try:
            size = f.stat().st_size
            if size == 0:
                continue
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) == 0:
                resident += sum(v & 1 for v in vec)
                pages += n
            libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return round(resident / pages, 4) if pages else None


# ---------------------------------------------------------------------------------------------
# Prompts

WORDS = (
    "the agent reads a file and writes a short plan before it calls the next tool with the result of "
    "every step so that later turns can refer back to what was found earlier in the session while "
    "other agents keep working on their own tasks in parallel and report progress to the planner "
    "which merges their notes into one summary for the user who asked for a review of the code the "
    "tests the build and the deployment including logs metrics traces errors warnings and the time "
    "each stage took on the machine that ran it yesterday and today after the cache was cleared"
).split()


class Prompts:
    """Chat histories of a given token length, counted with the served model's own chat template."""

    def __init__(self, model_dir: Path):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

    def count(self, messages: list[dict]) -> int:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding

    @staticmethod
    def words(rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def history(self, seed: int, n_tokens: int, turn_words: int = 120) -> list[dict]:
        """Alternating user/assistant turns, about `n_tokens` long in the template. The first words
        are a per-seed nonce so that no two histories share more than the template's first tokens."""
        rng = random.Random(seed)
        msgs = [{"role": "user", "content": f"session {seed:016x}: " + self.words(rng, turn_words)}]
        while self.count(msgs) < n_tokens:
            role = "assistant" if msgs[-1]["role"] == "user" else "user"
            msgs.append({"role": role, "content": self.words(rng, turn_words)})
        if msgs[-1]["role"] == "user" and len(msgs) > 1:
            msgs.append({"role": "assistant", "content": self.words(rng, 8)})
        # trim the last message so the history (without the next user turn) is close to n_tokens
        words = msgs[-1]["content"].split(" ")
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            msgs[-1]["content"] = " ".join(words[:mid])
            if self.count(msgs) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        msgs[-1]["content"] = " ".join(words[:lo])
        return msgs


class Conversation:
    """One agent's conversation: a history, then short new user turns and the replies it got."""

    def __init__(self, agent: str, messages: list[dict], seed: int, user_words: int, **meta: Any):
        self.agent, self.messages, self.seed, self.user_words = agent, messages, seed, user_words
        self.meta = meta
        self.turns = 0

    def ask(self) -> list[dict]:
        rng = random.Random(self.seed * 1000 + self.turns)
        self.messages.append({"role": "user", "content": f"turn {self.turns}: " + Prompts.words(rng, self.user_words)})
        self.turns += 1
        return self.messages

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


# ---------------------------------------------------------------------------------------------
# Servers and requests

# The batch section records this as each assistant turn instead of the random model's output, which
# often does not survive a detokenize/retokenize round trip: vllm-mlx then prefers an older entry that
# is an exact prefix over the newest one (an LCP match) and re-prefills hundreds of tokens per turn,
# which would turn a decoding benchmark into a prefill one. Both systems see the same prompts.
FIXED_REPLY = "noted, continuing with the next step"

# Extra persist_q4 options for every server of a run (bench --persist-options), e.g. to compare a setting.
PERSIST_OPTIONS: dict = {}


def make_server(system: str, model: Path, home: Path, cache_mb: float, options: Optional[dict] = None) -> Server:
    """A server of `system` (tools/serving's system_server): persist_q4 with `options`, then the run's
    --persist-options."""
    return system_server(system, model, home, cache_mb, {**(options or {}), **PERSIST_OPTIONS})


def server_flags(system: str, cache_mb: float, quote: bool = True) -> str:
    """`system`'s command line from the model on, as the report shows it."""
    return system_flags(system, cache_mb, PERSIST_OPTIONS, quote)


def cache_paths(home: Path) -> list[Path]:
    """Everything a server may persist: persist_q4's dir, vllm-mlx's snapshot and its SSD tier."""
    return [home / ".cache", home / "ssd"]


class Session:
    """A server plus its event log (start/stop timings) and one OpenAI client."""

    def __init__(self, system: str, server: Server, events: list[dict], phase: str):
        self.system, self.server, self.events, self.phase = system, server, events, phase
        self.client = None

    def start(self, note: str = "") -> float:
        import openai

        t = time.perf_counter()
        self.server.start(timeout=900)
        dt = time.perf_counter() - t
        self.events.append({"system": self.system, "phase": self.phase, "event": "start", "note": note,
                            "seconds": round(dt, 3)})
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="bench", max_retries=0, timeout=7200)
        # No warm-up request: the first measured turn pays what a user's first request after a start
        # pays (persist_q4 runs its own warm-up at start-up; vllm-mlx has none).
        return dt

    def stop(self, sig: int = signal.SIGTERM, note: str = "") -> float:
        t = time.perf_counter()
        self.server.stop(sig, timeout=900)
        dt = time.perf_counter() - t
        self.events.append({"system": self.system, "phase": self.phase, "event": f"stop {signal.Signals(sig).name}",
                            "note": note, "seconds": round(dt, 3)})
        return dt


_PERSIST_RE = re.compile(r"\[persist_q4\] agent=(\S+) (?:HIT (hot|disk)(?: from parent \S+)? cached=(\d+)|MISS)")
_FETCH_RE = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS)(?:[^\n]*? cached=(\d+))?")
_SSD_RE = re.compile(r"\[ssd_promote\] request=\S+ [^\n]*?promote: (\d+)/(\d+) tokens from SSD")


def classify(log: str, agent: Optional[str]) -> tuple[str, int]:
    """(tier, reused tokens) of one turn from the server log lines it produced:
    memory / disk / cold, from persist_q4's lookup lines or vllm-mlx's cache_fetch / ssd_promote lines."""
    hits = [m for m in _PERSIST_RE.finditer(log) if m.group(1) == (agent or "<anonymous>")]
    if hits:
        m = hits[-1]
        return {"hot": "memory", "disk": "disk"}.get(m.group(2) or "", "cold"), int(m.group(3) or 0)
    ssd = list(_SSD_RE.finditer(log))
    if ssd:
        return "disk", int(ssd[-1].group(1))
    fetch = list(_FETCH_RE.finditer(log))
    if fetch and fetch[-1].group(1) == "HIT" and int(fetch[-1].group(2) or 0) > 0:
        return "memory", int(fetch[-1].group(2))
    return "cold", 0


def send(session: Session, messages: list[dict], agent: Optional[str], max_tokens: int,
         client: Any = None, classify_log: bool = True, metadata: Optional[dict] = None,
         headers: Optional[dict] = None) -> dict:
    """One streamed chat turn. TTFT = send to first non-empty content chunk. `headers`: extra request
    headers (e.g. X-KV-Edit); `usage.kv_edit`, when the server reports one, comes back as `kv_edit`."""
    srv = session.server
    pos = srv.log_path.stat().st_size if classify_log else 0
    client = client or session.client
    headers = {**({"X-Agent-ID": agent} if agent else {}), **(headers or {})} or None
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=srv.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers, **({"metadata": metadata} if metadata else {}))
    first = last = None
    parts: list[str] = []
    usage = None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
            if first is None:
                first = now
            last = now
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    end = time.perf_counter()
    out = {
        "ttft_s": round((first if first is not None else end) - t0, 4),
        "total_s": round(end - t0, 4),
        "t_send": t0, "t_first": first, "t_last": last, "t_end": end,
        "text": "".join(parts),
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None),
    }
    details = getattr(usage, "prompt_tokens_details", None)
    out["usage_cached_tokens"] = getattr(details, "cached_tokens", None) if details else None
    out["kv_edit"] = usage.model_dump().get("kv_edit") if usage is not None else None
    if classify_log:
        # No wait: the lines classify() reads (persist_q4's lookup, vllm-mlx's cache_fetch/ssd_promote)
        # are logged at the request's fetch, before its first token, by a server whose log handlers
        # write through (PYTHONUNBUFFERED, logging flushes each record): in the file before the reply.
        with open(srv.log_path, errors="replace") as f:
            f.seek(pos)
            seg = f.read()
        out["tier"], out["reused_tokens"] = classify(seg, agent)
    return out


def _turn_record(r: dict, **kw: Any) -> dict:
    keep = ("ttft_s", "total_s", "prompt_tokens", "completion_tokens", "usage_cached_tokens", "tier", "reused_tokens")
    return {**kw, **{k: r.get(k) for k in keep}}




@dataclass
class Ctx:
    plan: Plan
    work: Path
    model: Optional[Path]  # the llama model of the ttft/agents/batch/reload sections (None if none runs)
    prompts: Optional[Prompts]


def section_failed(errors: dict, section: str, system: str, session: Session, e: Exception) -> None:
    """Record a system's failure in a section (its reason and the server's last log lines) and go on."""
    errors[system] = f"{type(e).__name__}: {e}\n{session.server.log_tail(30)}"
    say(f"{section}: {system} FAILED: {e}")
    traceback.print_exc()


def at_once(n: int, before: Callable[[int], Any], request: Callable[[int, Any], dict],
            log_path: Optional[Path] = None) -> tuple[list[dict], str]:
    """Run `request(i, before(i))` for i < n on n threads that meet at a barrier after `before`, so
    the n requests leave together. Returns their results and the server log written meanwhile (from
    `log_path`, "" without one); the first error is raised (it breaks the barrier, so no thread waits
    for one that failed)."""
    barrier = threading.Barrier(n)
    res: list[Optional[dict]] = [None] * n
    errs: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            arg = before(i)
            barrier.wait()
            res[i] = request(i, arg)
        except BaseException as e:  # noqa: BLE001 - raised below
            errs.append(e)
            barrier.abort()

    pos = log_path.stat().st_size if log_path else 0
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errs:
        raise next((e for e in errs if not isinstance(e, threading.BrokenBarrierError)), errs[0])
    if log_path is None:
        return res, ""  # type: ignore[return-value]
    # No wait: every request's fetch lines were logged before its first token (send() says why), and
    # every reply is complete here. Lines a server logs after a reply (a store's) may be missing.
    with open(log_path, errors="replace") as f:
        f.seek(pos)
        return res, f.read()  # type: ignore[return-value]
