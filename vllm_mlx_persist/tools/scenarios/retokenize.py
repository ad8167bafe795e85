"""`vllm-mlx-persist retokenize-stats`: how often, over multi-turn chats against a running server,
the next turn's prompt tokens leave the stored prompt + output tokens before the end of the previous
turn, and how many tokens reuse loses there (issue 10, item 3).

The server stores, per agent, the previous prompt P and the tokens it generated G (all but the last,
whose KV was never computed). The next prompt N is the conversation re-rendered with the reply as
text, re-tokenized. Token-id matching reuses LCP(N, P + G[:-1]); a perfect text-level match would
reuse all of P + G[:-1]. The difference is what re-rendering costs.

G is not returned by the API, so the tool regenerates it locally with the same model directory
(mlx-lm, greedy, 4-bit KV like the server) and keeps only turns whose local text equals the
server's reply; it then checks its predicted reuse against the server's reported cached_tokens.
Divergences are classed by bytes: `retokenized` (same bytes, other token ids: what text-level
matching recovers) and `text changed` (the reply's bytes differ from the generated tokens', e.g.
a token sequence that is not valid UTF-8 comes back with U+FFFD replacement characters).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .corpus import docstring_words
from .main import Record, make_client, send, served_model

MODULES = ("statistics", "difflib", "threading", "datetime", "argparse", "random", "textwrap", "fractions")


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LocalModel:
    """The server's model directory loaded locally: its tokenizer, chat template and greedy decoding."""

    def __init__(self, model_dir: str, kv_bits: Optional[int] = 4, kv_group_size: int = 64):
        import mlx_lm

        self.model, wrapper = mlx_lm.load(model_dir)
        self.tok = getattr(wrapper, "_tokenizer", wrapper)
        self.eos = set(getattr(wrapper, "eos_token_ids", None) or [self.tok.eos_token_id])
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self._bytes = _byte_decoder()

    def prompt(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens after `prompt`, the end-of-sequence token included when reached."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        kw: dict[str, Any] = {}
        if self.kv_bits:
            kw = dict(kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, quantized_kv_start=0)
        out: list[int] = []
        for (tok, _), _ in zip(generate_step(mx.array(prompt), self.model, max_tokens=max_tokens, **kw),
                               range(max_tokens)):
            out.append(int(tok))
            if out[-1] in self.eos:
                break
        return out

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self.eos])

    def raw_bytes(self, ids: list[int]) -> bytes:
        """The bytes a byte-level BPE token sequence stands for (special tokens as their text)."""
        out = bytearray()
        for piece in self.tok.convert_ids_to_tokens(ids):
            if all(ch in self._bytes for ch in piece):
                out += bytes(self._bytes[ch] for ch in piece)
            else:
                out += piece.encode()
        return bytes(out)


@dataclass
class Turn:
    conversation: int
    turn: int  # the turn whose prompt re-renders the previous reply (>= 1)
    prompt_tokens: int
    cached_tokens: int  # what the server reported
    previous_prompt: int  # the previous turn's prompt tokens (always a prefix of this prompt)
    stored: int  # previous turn's prompt + completion tokens - 1: what the server holds for the agent
    reusable: int  # min(stored, prompt_tokens - 1): what a perfect match would reuse
    diverged: bool  # cached < reusable: reuse stopped inside the stored tokens
    lost: int  # reusable - cached
    kind: str  # "none", "retokenized", "text changed" or "unclassified" (local greedy != server)
    recoverable: int = 0  # of `lost`: tokens a byte-level (text) match would still reuse
    at: str = ""  # a few characters of the re-rendered prompt around the divergence


TEXT_STATS = ("text_matches", "tokens_matched_by_text")


def text_match_stats(url: str) -> Optional[dict[str, int]]:
    """The server's text-matching counters (persist_q4 with match_text), or None where it has none."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(base + "/v1/cache/stats", timeout=30) as r:
            stats = json.load(r).get("engine_cache") or {}
    except (OSError, ValueError):
        return None
    return {k: int(stats[k]) for k in TEXT_STATS} if all(k in stats for k in TEXT_STATS) else None


def run(url: str, model_dir: str, *, conversations: int = 8, turns: int = 6, max_tokens: int = 48,
        words: int = 40, model: Optional[str] = None, kv_bits: Optional[int] = 4,
        progress=lambda s: None) -> dict[str, Any]:
    """Play `conversations` chats of `turns` turns each; measure every turn after the first."""
    local = LocalModel(model_dir, kv_bits=kv_bits)
    client = make_client(url)
    model = model or served_model(client)
    run_id = f"retok-{uuid.uuid4().hex[:8]}"
    measured: list[Turn] = []
    prompt_mismatch = 0
    before = text_match_stats(url)
    for c in range(conversations):
        progress(f"conversation {c + 1}/{conversations}")
        pool = docstring_words(MODULES[c % len(MODULES)])
        messages: list[dict] = []
        prev: Optional[tuple[list[int], list[int], Record]] = None  # (P, local G, server's answer)
        for t in range(turns):
            start = ((c // len(MODULES)) * turns + t) * words
            messages.append({"role": "user", "content": " ".join(pool[(start + i) % len(pool)] for i in range(words))})
            rec = Record("chat", t, "chat", f"{run_id}-{c}", None, False, list(messages), max_tokens)
            send(client, model, rec, rec.agent_id, None)
            P = local.prompt(messages)
            if len(P) != rec.prompt_tokens:
                prompt_mismatch += 1
            if prev is not None:
                measured.append(_measure(local, c, t, prev, P, rec))
            G = local.greedy(P, max_tokens)
            prev = (P, G, rec)
            messages.append({"role": "assistant", "content": rec.output})
    after = text_match_stats(url)
    # The server's counters over this run (exact only if nothing else used the server meanwhile).
    server_text = {k: after[k] - before[k] for k in TEXT_STATS} if before and after else None
    return summarize(measured, prompt_mismatch, dict(
        url=url, model=model, model_dir=str(model_dir), conversations=conversations, turns_per_chat=turns,
        max_tokens=max_tokens, words=words, local_kv_bits=kv_bits, server_text_matching=server_text))


def _measure(local: LocalModel, c: int, t: int, prev: tuple[list[int], list[int], Record], N: list[int],
             rec: Record) -> Turn:
    """Server figures for turn `t`; the cause of a divergence from the local replay when it agrees."""
    P, G, last = prev
    stored = last.prompt_tokens + last.completion_tokens - 1
    reusable = min(stored, rec.prompt_tokens - 1)
    diverged = rec.cached_tokens < reusable
    turn = Turn(c, t, rec.prompt_tokens, rec.cached_tokens, last.prompt_tokens, stored, reusable, diverged,
                reusable - rec.cached_tokens, "none")
    if not diverged:
        return turn
    local_stored = P + G[:-1]
    d = lcp(N, local_stored)
    # The local replay stands for the server's tokens only if it generated the same reply and
    # predicts the same point of divergence.
    if local.text(G) != last.output or len(local_stored) != stored or min(d, len(N) - 1) != rec.cached_tokens:
        turn.kind = "unclassified"
        return turn
    # Bytes of the stored reply tokens against the re-rendered prompt's bytes from the reply's start:
    # text-level matching could reuse every stored token that ends before the first differing byte.
    reply = G[:-1]
    rendered = local.raw_bytes(N[len(P):])
    ends, total = [], 0
    for tok in reply:
        total += len(local.raw_bytes([tok]))
        ends.append(total)
    whole = local.raw_bytes(reply)
    same = next((i for i, (a, b) in enumerate(zip(whole, rendered)) if a != b), min(len(whole), len(rendered)))
    turn.recoverable = max(0, sum(e <= same for e in ends) - (d - len(P)))
    turn.kind = "retokenized" if turn.recoverable > 0 else "text changed"
    turn.at = local.tok.decode(N[max(len(P), d - 2): d + 3])
    return turn


def summarize(turns: list[Turn], prompt_mismatch: int, config: dict) -> dict[str, Any]:
    div = [t for t in turns if t.diverged]
    kinds = ("retokenized", "text changed", "unclassified")
    by_kind = {k: [t for t in div if t.kind == k] for k in kinds}
    return {
        **config,
        "turns_measured": len(turns),
        "prompt_length_mismatches": prompt_mismatch,  # local chat template + tokenizer vs the server
        "diverged": len(div),
        "tokens_reusable": sum(t.reusable for t in turns),
        "tokens_lost": sum(t.lost for t in div),
        "by_kind": {k: {"turns": len(v), "tokens_lost": sum(t.lost for t in v)} for k, v in by_kind.items()},
        "tokens_recoverable": sum(t.recoverable for t in div),  # by matching text instead of token ids
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "measured": [asdict(t) for t in turns],
    }


def format_report(r: dict[str, Any]) -> str:
    n = r["turns_measured"] or 1
    k = r["by_kind"]
    lines = [
        f"model {r['model_dir']} on {r['url']}: {r['conversations']} conversations x {r['turns_per_chat']} turns, "
        f"{r['words']}-word user turns, max_tokens {r['max_tokens']}",
        f"turns measured (all after the first of each chat): {r['turns_measured']}; local prompt length "
        f"!= server's: {r['prompt_length_mismatches']} (a turn served by text matching counts the stored tokens)",
        f"turns where reuse stops inside the previous turn's stored tokens: {r['diverged']} ({100 * r['diverged'] / n:.0f}%)",
        f"tokens lost there: {r['tokens_lost']} of {r['tokens_reusable']} reusable "
        f"({100 * r['tokens_lost'] / max(r['tokens_reusable'], 1):.1f}%); prompt tokens {r['prompt_tokens']}, "
        f"cached {r['cached_tokens']}",
        f"  diverging token ids over the same bytes (retokenized): {k['retokenized']['turns']} turns, "
        f"{k['retokenized']['tokens_lost']} tokens lost, of which text-level matching would reuse "
        f"{r['tokens_recoverable']} (up to the first byte that differs)",
        f"  the reply's bytes differ at once from the generated tokens' (e.g. U+FFFD for invalid UTF-8): "
        f"{k['text changed']['turns']} turns, {k['text changed']['tokens_lost']} tokens",
        f"  unclassified (the local greedy replay differs from the server's reply): {k['unclassified']['turns']} turns, "
        f"{k['unclassified']['tokens_lost']} tokens",
    ]
    st = r.get("server_text_matching")
    lines.append("server's text matching over this run: " + (
        f"{st['text_matches']} realignments, {st['tokens_matched_by_text']} stored tokens reused past a token "
        "mismatch (counted in cached above)" if st else "no counters (not persist_q4, or an older server)"))
    for t in [t for t in r["measured"] if t["diverged"] and t["at"]][:5]:
        lines.append(f"  e.g. chat {t['conversation']} turn {t['turn']}: {t['kind']}, lost {t['lost']}, at {t['at']!r}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist retokenize-stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-dir", required=True, help="the model directory the server serves (.models/default)")
    p.add_argument("--model", help="model name to request (default: the first the server lists)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--words", type=int, default=40, help="words per user turn")
    p.add_argument("--local-kv-bits", type=int, default=4, help="KV bits of the local greedy run (0: float)")
    p.add_argument("--json", type=Path, metavar="PATH")
    args = p.parse_args(argv)
    report = run(args.url, args.model_dir, conversations=args.conversations, turns=args.turns,
                 max_tokens=args.max_tokens, words=args.words, model=args.model, kv_bits=args.local_kv_bits or None,
                 progress=lambda s: print(f"[retokenize] {s}", file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
