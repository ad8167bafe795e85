"""What the 4-bit cache costs in quality, measured against mlx-lm's float cache.

`vllm-mlx-persist quality` enters main.py (a small llama trained on local text, train.py; the
formats, kv_formats.py; the measurement through the cache, measure.py; per family, families.py;
the report, report.py); `quality --model DIR` measures a real checkpoint on held-out text (real.py,
heldout.py). Also `calibrate` (calibrate.py), `splice-drift` (splice_drift.py) and
`batch-invariance` (batch_invariance.py).
"""
