"""Speed and memory, measured on real servers and against vllm-mlx's own caches in the same run.

`vllm-mlx-persist bench` enters main.py: one module per section (ttft, agents, batch, reload,
families, fanout, fleet, capacity, edits*), what they share (kit.py), the report (report.py,
plots.py). Standalone benchmarks, each `python -m vllm_mlx_persist.tools.bench.NAME`: decode,
window, warmup, hotturn, key_formats, first_start, blas (rows.py: per-row products and the BLAS a
process loaded, also used by the tests).
"""
