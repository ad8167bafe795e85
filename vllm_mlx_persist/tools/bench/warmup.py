"""`python -m vllm_mlx_persist.tools.bench.warmup`: first turn after a SIGKILL restart against a hot turn,
with the start-up warm-up on and off, on real `vllm-mlx serve` processes (a tool; the server never
imports it). Prints TTFTs and the restart/hot ratio per setting."""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

import openai

from ..models.build import build_model_dir
from ..serving import Server


def _ttft(srv: Server, messages: list[dict], agent: str) -> float:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)
    t = time.perf_counter()
    stream = client.chat.completions.create(model=srv.model, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"metadata": {"agent_id": agent}})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t
    return first if first is not None else time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_mlx_persist.tools.bench.warmup", description=__doc__)
    p.add_argument("--size", default="small")
    p.add_argument("--words", type=int, default=600, help="words of history (about 1.3 tokens each)")
    p.add_argument("--reps", type=int, default=3, help="restarts per setting")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="warmup-bench-"))
    model = build_model_dir(work / "model", arch="llama", size=a.size)
    history = " ".join(f"word{i % 97} step" for i in range(a.words // 2))
    base = [{"role": "user", "content": history}, {"role": "assistant", "content": "noted"}]
    print("| warmup | rep | hot TTFT s | after SIGKILL TTFT s | ratio |")
    print("|---|---|---|---|---|")
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(a.reps):
        for warm in (True, False) if rep % 2 == 0 else (False, True):
            srv = Server(model, work / f"home-{warm}-{rep}", options={"warmup": warm}).start()
            try:
                agent = f"a{rep}"
                _ttft(srv, base + [{"role": "user", "content": "first question"}], agent)  # cold, cached
                hot = _ttft(srv, base + [{"role": "user", "content": "second question"}], agent)
                srv.restart(signal.SIGKILL)
                after = _ttft(srv, base + [{"role": "user", "content": "third question"}], agent)
            finally:
                srv.stop()
            ratios[warm].append(after / hot)
            print(f"| {warm} | {rep} | {hot:.3f} | {after:.3f} | {after / hot:.2f} |", flush=True)
    for warm, rs in ratios.items():
        print(f"warmup={warm}: after-restart/hot median {statistics.median(rs):.2f} (range {min(rs):.2f}-{max(rs):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
