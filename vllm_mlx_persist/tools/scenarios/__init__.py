"""Multi-agent workloads driven against a running server through the openai client.

`vllm-mlx-persist scenario` enters main.py (scenario files: spec.py, shipped/*.yaml; their text:
corpus.py); `vllm-mlx-persist retokenize-stats` enters retokenize.py.
"""
