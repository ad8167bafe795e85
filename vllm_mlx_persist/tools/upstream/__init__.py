"""vllm-mlx's own test suite against the seam: `vllm-mlx-persist patch --upstream-tests` enters
suite.py; copies.py makes pristine and patched copies of the installed vllm_mlx and fetches the suite.
"""
