"""vllm-mlx-persist: persistent, per-agent 4-bit KV caches for vllm-mlx."""

__version__ = "0.1.0"
