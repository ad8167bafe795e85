"""`python -m vllm_mlx_persist.tools.bench.blas --model-dir DIR`: decode tokens per second on persist_q4's
caches under the BLAS this process loaded (OpenBLAS's kernel set: `OPENBLAS_CORETYPE`; mlx-cpu's own
without LD_PRELOAD), alone and batched, with the model's projections as the BLAS gives them and one
token row at a time (`--rows`: what batch-invariant decode projections would cost). A tool; the server
never imports it. docs/design.md, "Batch invariance", has the numbers and the command that made them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from ...caches import ModelCodec
from ...caches.attention import install_attention_fix
from . import rows as blas


def per_row_projections() -> None:
    """Every Linear (and tied embedding head) one token row at a time: a row's product is then the
    same BLAS call whatever the batch (the tests' `row_by_row`, for Linear layers only)."""

    nn.Linear.__call__ = blas.row_linear
    nn.Embedding.as_linear = lambda self, x: blas.row_products(x, self.weight)


def decode_rate(model, codec, batch: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    """Tokens per second of wall time and of this process's CPU time over the decode steps once
    every row has its first token (prefill, one prompt per call as persist_q4 serves, not counted).
    CPU time is the steadier of the two on a shared machine (one BLAS thread)."""
    prompts = [[(i * 37 + r * 101) % 20000 + 10 for i in range(prompt_len + r)] for r in range(batch)]
    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=512, prefill_batch_size=1)
    uids = gen.insert(prompts, max_tokens=[max_tokens] * batch, caches=[codec.make_cache() for _ in prompts])
    started: set[int] = set()
    while len(started) < len(uids):
        started.update(r.uid for r in gen.next()[1])
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        got = gen.next()[1]
        if not got:
            break
        tokens += len(got)
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def prefill_rate(model, codec, prompt_len: int) -> tuple[float, float]:
    """Tokens per second (wall, CPU) of one prompt's prefill in 512-token chunks on fresh caches."""
    tokens = mx.array([[(i * 37) % 20000 + 10 for i in range(prompt_len)]])
    cache = codec.make_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, prompt_len, 512):
        mx.eval(model(tokens[:, s : s + 512], cache=cache))
    return prompt_len / (time.perf_counter() - t0), prompt_len / (time.process_time() - c0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 4], help="decode batch sizes (none: prefill only)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=17)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill", type=int, default=0, metavar="N", help="also time an N-token prompt's prefill")
    p.add_argument("--rows", action="store_true", help="the model's projections one token row at a time")
    args = p.parse_args(argv)
    install_attention_fix()
    if args.rows:
        per_row_projections()
    model, _ = load(args.model_dir)
    codec = ModelCodec.for_model(model)
    if args.prefill:
        wall, cpu = zip(*[prefill_rate(model, codec, args.prefill) for _ in range(args.reps)])
        print(f"{blas.kernel():<24} {'per-row' if args.rows else 'as BLAS':<8} prefill {args.prefill}: "
              f"{statistics.median(cpu):7.1f} tok/s of CPU time, {statistics.median(wall):7.1f} of wall time "
              f"(median of {args.reps}; CPU: {', '.join(f'{r:.1f}' for r in cpu)})", flush=True)
    for b in args.batch:
        wall, cpu = zip(*[decode_rate(model, codec, b, args.prompt_len, args.max_tokens) for _ in range(args.reps)])
        print(f"{blas.kernel():<24} {'per-row' if args.rows else 'as BLAS':<8} batch {b}: "
              f"{statistics.median(cpu):7.1f} tok/s of CPU time, {statistics.median(wall):7.1f} of wall time "
              f"(median of {args.reps}; CPU: {', '.join(f'{r:.1f}' for r in cpu)})", flush=True)


if __name__ == "__main__":
    main()
