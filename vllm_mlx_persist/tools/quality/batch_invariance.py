"""`vllm-mlx-persist batch-invariance`: does a prompt's answer depend on the prompts served with it?

Through real `vllm-mlx serve` processes (tools/serving/), per model family: the same prompts are
sent to each server alone (one after another), then several at once, `together` (released at the
same instant) and `staggered` (each released when the one before it has streamed its first token,
so it joins a batch already decoding), in groups of `group`; greedy answers (streamed) are compared
with the prompt's answer alone on the same server. Whether each group was batched for real is read
from the server's own log (vllm-mlx's running count as it admitted each request), not from timing,
and a group that was not is reported. Servers: vllm-mlx's own cache (no --cache-backend) and
persist_q4 variants (`SERVERS`). Each request of each mode has its own agent id, so nothing is
reused between modes.

Printed: a table family x server x answers that differ from alone (per mode) and, for persist_q4
servers, prompts whose stored 4-bit K/V differ from alone (read back from the disk tier: answers flip
only where two logits are closer than the noise, while the K/V show any change in how a prompt was
computed). Exit status 1 when a persist_q4 answer differs where vllm-mlx's answer to that prompt in
that mode does not (`persist_q4 batch_prefill`, the behaviour before one prompt per prefill call, is
shown for comparison only). docs/design.md ("Batch invariance") quotes its tables;
tests/test_e2e_batch_invariance.py runs a small case per family. Tiny random-weight models, built
locally (`make-model` presets with overrides).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Any, Callable, Optional, Sequence

from ..scenarios.corpus import document
from ..models.build import build_model_dir
from ..serving import Server

MODES = ("together", "staggered")
BATCH_ATTEMPTS = 3  # sends of a group that the server did not run batched (see `send`)
# Sliding windows far shorter than the prompts, so sliding layers drop their oldest columns.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window": 32, "sliding_window_pattern": 2},
    "gpt_oss": {"sliding_window": 32},
    "qwen3_next": {},
    "deepseek_v3": {},
}
# Server name -> persist_q4 options (None: vllm-mlx's own cache, no --cache-backend).
SERVERS: dict[str, Optional[dict[str, Any]]] = {
    "vllm-mlx": None,
    "persist_q4": {},
    "persist_q4 quantized": {"decode_float_mb": 0, "carry_float_mb": 0, "prefill_attention": "quantized"},
    # What persist_q4 did before one prompt per prefill call: vllm-mlx's batched prefill.
    "persist_q4 batch_prefill": {"batch_prefill": True},
}
DEMO_ONLY = {"persist_q4 batch_prefill"}  # shown for comparison; the exit status ignores it
BASE_OPTIONS = {"block_size": 32, "hot_mb": 64, "match_text": False}
_MODULES = ("json.decoder", "textwrap", "argparse", "csv", "heapq", "functools", "shlex", "fractions",
            "string", "random", "statistics", "difflib", "calendar", "pprint", "copy", "bisect", "glob", "fnmatch")


def prompts(n: int, words: int = 60, first: int = 0) -> list[str]:
    """`n` distinct prompts of about `words` to `words + 50` words (docstrings of stdlib modules)."""
    out = []
    for i in range(first, first + n):
        mods = [_MODULES[i % len(_MODULES)], _MODULES[(i * 7 + 3) % len(_MODULES)]]
        out.append(f"question {i}: " + document(mods, words + (i * 17) % 50))
    return out


@dataclass
class Answers:
    """One mode's answers on one server, and what the server saw of each group's requests."""

    texts: list[str]
    prompt_tokens: list[int]
    agents: list[str]
    # Per group of requests sent together: the server's count of running requests as it admitted
    # each one, in the order it admitted them (vllm-mlx's `[schedule] ... running=N` log lines).
    admissions: list[list[int]] = field(default_factory=list)

    def overlapped(self) -> bool:
        """Whether every request was in flight at the server while another one was (batched for
        real): in each group, every request after the first was admitted while an earlier one was
        still running, so the first overlapped the second and each later one an earlier one."""
        return all(len(a) >= 2 and all(r >= 2 for r in a[1:]) for a in self.admissions)


_SCHEDULED = re.compile(r"\[schedule\] request=\S+ uid=\d+ .*\brunning=(\d+)\b")


def admissions(log_text: str) -> list[int]:
    """The running counts of vllm-mlx's `[schedule]` log lines in `log_text`, in order."""
    return [int(m.group(1)) for m in _SCHEDULED.finditer(log_text)]


class _Log:
    """What a server appended to its log from here on."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def since(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")


def _client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def ask(server: Server, prompt: str, agent: str, max_tokens: int, *, client: Any = None,
        on_first_token: Optional[Callable[[], None]] = None) -> tuple[str, int]:
    """One greedy chat completion, streamed: (text, prompt tokens). `on_first_token` is called as
    the first generated token arrives (the request is decoding at the server)."""
    stream = (client or _client(server)).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.0, metadata={"agent_id": agent}, stream=True, stream_options={"include_usage": True})
    parts: list[str] = []
    prompt_tokens = -1
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            if choice.delta.content is None and choice.finish_reason is None:
                continue  # the role chunk vllm-mlx sends before generating
            if on_first_token is not None:
                on_first_token()
                on_first_token = None
            parts.append(choice.delta.content or "")
    return "".join(parts), prompt_tokens


def send(server: Server, texts: Sequence[str], mode: str, max_tokens: int, group: int = 0,
         tag: str = "") -> Answers:
    """Send `texts` in `mode`: "alone" (one after another) or, `group` at a time (0: all),
    "together" (released at once) or "staggered" (each released when the one before it has
    streamed its first token, so it joins a batch already decoding). Nothing waits on a clock."""
    n = len(texts)
    out: list = [None] * n
    errors: list[BaseException] = []
    agents = [f"{tag}{mode}-{i}" for i in range(n)]

    def one(i: int, client: Any, ready: Optional[Callable[[], None]] = None,
            first: Optional[threading.Event] = None) -> None:
        try:
            if ready is not None:
                ready()
            out[i] = ask(server, texts[i], agents[i], max_tokens, client=client,
                         on_first_token=first.set if first is not None else None)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append(e)
        finally:
            if first is not None:
                first.set()  # never leave the next request waiting on one that failed

    groups: list[list[int]] = []
    if mode == "alone":
        client = _client(server)
        for i in range(n):
            one(i, client)
    elif mode in MODES:
        size = group or n
        for lo in range(0, n, size):
            idx = list(range(lo, min(lo + size, n)))
            # A group the server did not run batched (a request admitted after the ones before it had
            # finished: its client was slower than their decoding, as on a loaded machine) is sent again
            # under fresh agents, up to BATCH_ATTEMPTS times; the last attempt's admissions are kept.
            for attempt in range(BATCH_ATTEMPTS):
                for i in idx:
                    agents[i] = f"{tag}{mode}-{i}" if attempt == 0 else f"{tag}{mode}-{i}-again{attempt}"
                log = _Log(server.log_path)
                if mode == "together":
                    barrier = threading.Barrier(len(idx))
                    threads = [threading.Thread(target=one, args=(i, _client(server), barrier.wait)) for i in idx]
                else:  # staggered: request k waits for request k-1's first token
                    firsts = [threading.Event() for _ in idx]
                    threads = [threading.Thread(target=one, args=(i, _client(server), firsts[k - 1].wait if k else None,
                                                                  firsts[k]))
                               for k, i in enumerate(idx)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
                seen = admissions(log.since())
                if Answers([], [], [], [seen]).overlapped():
                    break
                print(f"batch-invariance: {mode} group {idx} not run batched (running counts {seen}), sending "
                      f"it again", file=sys.stderr, flush=True)
            groups.append(seen)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if errors:
        raise errors[0]
    return Answers([t for t, _ in out], [p for _, p in out], agents, groups)


def differing(alone: Answers, batched: Answers) -> list[int]:
    """Indices of the prompts whose answer batched differs from alone."""
    return [i for i, (a, b) in enumerate(zip(alone.texts, batched.texts)) if a != b]


def stored_prompt_kv(home: Path, agent: str, n_prompt: int) -> list[dict[str, Any]]:
    """What a persist_q4 server with HOME `home` stored for `agent`'s prompt, read from its disk tier:
    per block lying wholly within the first `n_prompt` tokens, its layers' arrays by name (numpy).

    Those tokens are prefilled (and the last one decoded first) before the answer's first token,
    so the 4-bit K/V of a prompt sent alone and batched must be the same bits; the blocks' ids
    differ (they are seeded by the agent), their arrays must not."""
    from ...disk_format import MODEL_JSON
    from ...store import DiskStore

    root = home / ".cache" / "vllm-mlx-persist"
    for model_dir in (p for p in root.iterdir() if (p / MODEL_JSON).is_file()):
        store = DiskStore.open_existing(model_dir)
        manifest = store.read_manifest(agent)
        if manifest is None:
            continue
        out, at = [], 0
        for block_id in manifest.block_ids:
            block = store.read_block(block_id)
            at += len(block.tokens)
            if at > n_prompt:
                break
            # layers' arrays only ("{layer}.…"): `win.from` and checkpoint positions are bookkeeping
            out.append({k: a for k, a in block.arrays.items() if k.split(".", 1)[0].isdigit()})
        return out
    raise LookupError(f"no manifest for agent {agent!r} under {root}")


def kv_differs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two agents' stored prompt blocks hold different bits for the same positions.

    A sliding layer keeps what its live cache still held at the turn's end, which batched can be
    more (its drops follow the batch): its arrays then cover the last k tokens of the block in one
    and more in the other, and the last k must agree (absent in one: nothing to compare)."""
    if len(a) != len(b):
        return True
    for x, y in zip(a, b):
        for k in x.keys() & y.keys():
            p, q = x[k], y[k]
            if p.shape != q.shape:
                if p.ndim != 4 or p.shape[:2] != q.shape[:2] or p.shape[3:] != q.shape[3:]:
                    return True
                n = min(p.shape[2], q.shape[2])
                p, q = p[:, :, p.shape[2] - n:], q[:, :, q.shape[2] - n:]
            if p.dtype != q.dtype or p.tobytes() != q.tobytes():
                return True
    return False


def start_servers(model: Path, home: Path, names: Sequence[str], options: Optional[dict] = None) -> dict[str, Server]:
    """One server per name of SERVERS, started in parallel, each with its own HOME under `home`."""
    servers = {}
    for name in names:
        opts = SERVERS[name]
        backend = None if opts is None else "persist_q4"
        full = None if opts is None else {**BASE_OPTIONS, **(options or {}), **opts}
        servers[name] = Server(model, home / name.replace(" ", "-"), backend=backend, options=full)
    with ThreadPoolExecutor(len(servers)) as pool:
        # 900 s as the bench: a first start of a bigger model under load (Gemma 3 270M) passed 180 s
        started = [pool.submit(s.start, 900) for s in servers.values()]
    if any(f.exception() for f in started):
        for s in servers.values():
            s.stop()  # the ones that did start
        raise next(f.exception() for f in started if f.exception())
    return servers


def run_family(servers: dict[str, Server], texts: Sequence[str], max_tokens: int, group: int = 0,
               modes: Sequence[str] = MODES) -> dict[str, dict[str, Any]]:
    """Every server: answers alone and in each mode, and for persist_q4 servers the prompts whose
    stored 4-bit K/V differ from alone ("kv": {mode: [index]}). Returns {server: {"alone": Answers,
    mode: Answers, ..., "kv": ...}}; servers run one after another so their timings do not mix."""
    results = {}
    for name, srv in servers.items():
        got: dict[str, Any] = {mode: send(srv, texts, mode, max_tokens, group) for mode in ("alone", *modes)}
        if srv.backend:
            got["kv"] = {m: kv_differing(srv, got["alone"], got[m]) for m in modes}
        results[name] = got
    return results


def kv_differing(server: Server, alone: Answers, batched: Answers) -> list[int]:
    """Indices of the prompts whose stored prompt K/V batched differ from alone (persist_q4)."""
    read = lambda agent, n: stored_prompt_kv(server.home, agent, n)
    return [i for i, n in enumerate(alone.prompt_tokens)
            if kv_differs(read(alone.agents[i], n), read(batched.agents[i], n))]


def _cell(d: list[int], n: int) -> str:
    return f"{len(d)} of {n}" + (f" {d}" if d else "")


def table(results: dict[str, dict[str, dict[str, Any]]], modes: Sequence[str] = MODES) -> str:
    """Markdown: family x server x answers that differ batched vs alone, and prompts whose stored
    4-bit K/V differ (persist_q4 only), per mode."""
    head = [f"answers differ, {m}" for m in modes] + [f"prompt K/V differ, {m}" for m in modes]
    lines = ["| family | server | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for family, per_server in results.items():
        for name, got in per_server.items():
            n = len(got["alone"].texts)
            cells = [_cell(differing(got["alone"], got[m]), n) for m in modes]
            cells += [_cell(got["kv"][m], n) if "kv" in got else "-" for m in modes]
            lines.append(f"| {family} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unexplained(per_server: dict[str, dict[str, Any]], reference: str = "vllm-mlx",
                modes: Sequence[str] = MODES) -> dict[str, dict[str, list[int]]]:
    """Per persist_q4 server and mode, the prompts whose answer differs batched vs alone while the
    reference server's does not: the only differences the check does not accept."""
    ref = per_server[reference]
    out: dict[str, dict[str, list[int]]] = {}
    for name, answers in per_server.items():
        if name == reference:
            continue
        for m in modes:
            extra = sorted(set(differing(answers["alone"], answers[m])) - set(differing(ref["alone"], ref[m])))
            if extra:
                out.setdefault(name, {})[m] = extra
    return out


def _generate(model: Any, codec: Any, prompts_ids: Sequence[list[int]], rows: Sequence[int], max_tokens: int,
              prefill_batch_size: int) -> dict[int, tuple[list[int], list[Any]]]:
    """`rows` inserted at once into one mlx-lm BatchGenerator as vllm-mlx builds it (prefill steps of
    2048 tokens); per row its greedy tokens and each step's logprobs. `codec`: persist_q4's caches
    (as its backend makes them), or None for mlx-lm's own (vllm-mlx's default)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=2048,
                         prefill_batch_size=prefill_batch_size, completion_batch_size=32)
    caches = None if codec is None else [codec.make_cache() for _ in rows]
    uids = gen.insert([prompts_ids[r] for r in rows], max_tokens=[max_tokens] * len(rows), caches=caches)
    row_of = dict(zip(uids, rows))
    out: dict[int, tuple[list[int], list[Any]]] = {r: ([], []) for r in rows}
    while any(len(out[r][0]) < max_tokens for r in rows):
        for resp in gen.next()[1]:
            tokens, logprobs = out[row_of[resp.uid]]
            tokens.append(resp.token)
            logprobs.append(resp.logprobs)
    return out


def logprob_differences(model_dir: Path, texts: Sequence[str], max_tokens: int, group: int,
                        prefill_batch_size: int, persist: bool) -> list[tuple[float, bool]]:
    """In one process: per prompt, the largest |Δlogprob| between alone and `group` at a time together,
    over the steps before the first token that differs, and whether one does."""
    import mlx.core as mx
    from mlx_lm import load

    from ...caches import ModelCodec
    from ...caches.attention import install_attention_fix

    model, tokenizer = load(str(model_dir))
    install_attention_fix()
    codec = ModelCodec.for_model(model, bounded=True) if persist else None
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    n = len(ids)
    alone = {r: _generate(model, codec, ids, [r], max_tokens, prefill_batch_size)[r] for r in range(n)}
    together: dict = {}
    for lo in range(0, n, group or n):
        together.update(_generate(model, codec, ids, range(lo, min(lo + (group or n), n)), max_tokens, prefill_batch_size))
    out = []
    for r in range(n):
        (ta, la), (tb, lb) = alone[r], together[r]
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        worst = max((mx.abs(x - y).max().item() for x, y in zip(la[: k + 1], lb[: k + 1])), default=0.0)
        out.append((worst, k < len(ta)))
    return out


def _models(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, Path]]:
    """(label, model directory) to measure: `--model-dir` as given, else each family's preset."""
    if args.model_dir is not None:
        yield args.model_dir.name, args.model_dir.resolve()
        return
    for arch in args.arch or list(FAMILIES):
        overrides = args.overrides if args.overrides is not None else FAMILIES.get(arch, {})
        yield arch, build_model_dir(work / f"model-{arch}-{args.size}-{args.seed}", arch=arch, size=args.size,
                                    seed=args.seed, overrides=overrides or None)


def _logprobs_main(args: argparse.Namespace, texts: Sequence[str], work: Path) -> int:
    """`--logprobs`: the in-process table (caches x prefill batch size x largest |Δlogprob| per prompt)."""
    import os

    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "no OpenBLAS preloaded"
    print(f"in one process, {blas} (servers preload it; mlx-cpu's own BLAS sums sequentially)", file=sys.stderr)
    print("| family | caches | prompts per prefill call | largest abs(logprob alone - batched), per prompt |")
    print("|---|---|---|---|")
    for arch, model in _models(args, work):
        for persist in (False, True):
            for pbs in (8, 1):
                diffs = logprob_differences(model, texts, args.max_tokens, args.group, pbs, persist)
                cells = ", ".join(f"{d:.1e}" + (" (token differs)" if flip else "") for d, flip in diffs)
                print(f"| {arch} | {'persist_q4' if persist else 'mlx-lm (vllm-mlx)'} | "
                      f"{'up to 8' if pbs > 1 else '1'} | {cells} |", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist batch-invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", help=f"families (repeatable; default: {', '.join(FAMILIES)})")
    p.add_argument("--size", default="tiny", help="make-model size preset (default tiny)")
    p.add_argument("--overrides", type=json.loads, default=None,
                   help="config.json keys over the preset, as JSON (default: FAMILIES' windows)")
    p.add_argument("--servers", default="vllm-mlx,persist_q4",
                   help=f"comma-separated, from: {', '.join(SERVERS)}")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--words", type=int, default=60, help="words per prompt, about (+0..49)")
    p.add_argument("--first", type=int, default=0, help="index of the first prompt (a different set)")
    p.add_argument("--group", type=int, default=3, help="requests at once in the batched modes (0: all)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="model weights' seed")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="measure this model directory (e.g. a real checkpoint from make-model --from-gguf) "
                        "instead of the families' presets")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--logprobs", action="store_true",
                   help="instead of servers: in one process, each step's logprobs alone vs `group` together, "
                        "on persist_q4's and mlx-lm's caches, with up to 8 (vllm-mlx's) and 1 prompt per prefill call")
    args = p.parse_args(argv)

    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in names if s not in SERVERS]
    if unknown or "vllm-mlx" not in names:
        p.error(f"--servers must include vllm-mlx and name only {', '.join(SERVERS)}; got {unknown or names}")
    work = args.dir or Path(tempfile.mkdtemp(prefix="vllm-mlx-persist-batch-"))
    texts = prompts(args.prompts, args.words, args.first)
    if args.logprobs:
        try:
            return _logprobs_main(args, texts, work)
        finally:
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
    results: dict[str, dict] = {}
    bad = False
    try:
        for arch, model in _models(args, work):
            servers = start_servers(model, work / f"home-{arch}-{time.time_ns()}", names)
            try:
                results[arch] = run_family(servers, texts, args.max_tokens, args.group)
            finally:
                for s in servers.values():
                    s.stop()
            for name, got in results[arch].items():
                for m in MODES:
                    if not got[m].overlapped():
                        print(f"{arch}: {name}, {m}: not batched (not every request was admitted while another "
                              f"ran; running counts per group: {got[m].admissions})", file=sys.stderr, flush=True)
            tokens = results[arch]["vllm-mlx"]["alone"].prompt_tokens
            print(f"{arch}: prompts of {min(tokens)}-{max(tokens)} tokens", file=sys.stderr, flush=True)
            extra = unexplained(results[arch])
            bad |= any(name not in DEMO_ONLY for name in extra)
            if extra:
                print(f"{arch}: differs where vllm-mlx does not: {extra}", file=sys.stderr, flush=True)
        print(table(results))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
