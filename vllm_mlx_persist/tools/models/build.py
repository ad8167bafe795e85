"""Build small, randomly initialised models that mlx-lm loads and vllm-mlx serves, without a hub.

Weights come from mlx-lm's own `Model` class for the architecture (so parameter names always
match what `mlx_lm.load` expects), re-drawn from a fixed seed and saved in float32. The tokenizer is
a byte-level BPE trained with `tokenizers` on a fixed, sorted list of CPython standard library
sources (present wherever Python is), with a ChatML chat template.

Builds are deterministic: the same (arch, size, seed) gives byte-identical files on one Python
version. The standard library text differs a little between Python versions, so the tokenizer
vocabulary (and nothing else) may differ across them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

# Bumped whenever the build changes what it writes, so stale stamps force a rebuild.
BUILD_FORMAT = 1
STAMP_FILE = "vllm_mlx_persist_model.json"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trained first, so they get ids 0..3 in this order.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END)
PAD_ID, BOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
EOS_IDS = [IM_END_ID, PAD_ID]

# ChatML. Content may be a string, None, or a list of parts (Anthropic/OpenAI style); only text
# parts are rendered.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Qwen 2.5's chat template, as its tool-calling models render conversations (trimmed of the default
# system prompt): assistant tool calls as <tool_call> JSON lines, and consecutive tool results inside
# ONE user turn, each in a <tool_response> block. `template="qwen"` models carry it with the four tags
# as added, non-special tokens (as Qwen's tokenizer has them); vllm-mlx renders role "tool" natively
# with it when served with a native tool parser (--enable-auto-tool-choice --tool-call-parser hermes).
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is iterable %}{%- set ns = namespace(t='') %}"
    "{%- for part in message['content'] %}{%- if part is string %}{%- set ns.t = ns.t + part %}"
    "{%- elif part['type'] == 'text' %}{%- set ns.t = ns.t + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = ns.t %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if content %}{{- '\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' }}{{- content }}{{- '\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TEMPLATES = {"chatml": CHAT_TEMPLATE, "qwen": QWEN_TEMPLATE}

# Training text for the tokenizer: pure-Python stdlib modules present in CPython 3.8 to 3.14,
# mostly English docstrings and comments. Missing files are skipped.
TOKENIZER_SOURCES = (
    "argparse.py", "bisect.py", "calendar.py", "cmd.py", "codecs.py", "colorsys.py",
    "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
    "difflib.py", "email/message.py", "fractions.py", "functools.py", "gettext.py", "glob.py",
    "heapq.py", "hmac.py", "html/parser.py", "http/client.py", "inspect.py", "json/decoder.py",
    "json/encoder.py", "locale.py", "logging/__init__.py", "mailbox.py", "numbers.py",
    "optparse.py", "pprint.py", "queue.py", "random.py", "sched.py", "shlex.py", "shutil.py",
    "statistics.py", "string.py", "subprocess.py", "tarfile.py", "textwrap.py", "threading.py",
    "typing.py", "unittest/case.py", "urllib/parse.py", "uuid.py", "warnings.py", "zipfile.py",
)
# Std of matrices is WEIGHT_GAIN / sqrt(fan_in). At 1.0, greedy argmax with a 4-bit KV cache agrees
# with float32 on 86-96% of positions (like real models); at 2.0 the model turns chaotic (22-44%).
WEIGHT_GAIN = 1.0
TOKENIZER_TEXT_CAP = 1_500_000  # characters; trains in ~0.4 s on 2 cores


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    sliding_window: int = 128  # gemma3_text only


# hidden == heads * head_dim everywhere, so every arch (qwen2 derives head_dim) gets the same shapes.
SIZES: dict[str, Size] = {
    # tests whose float work is most of their cost on a slow BLAS (prefill-heavy workloads that check
    # the cache, not the model): 0.56M params (llama), ~1/3 of tiny's float work per token, still GQA
    "micro": Size(layers=2, hidden=128, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=1024),
    # tests: 1.7M params (llama)
    "tiny": Size(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1024),
    # the default served model: 4.2M params
    "small": Size(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=2048),
    # benchmarks: 103M params, 393 MB of float32
    "bench": Size(layers=8, hidden=1024, heads=16, kv_heads=8, head_dim=64, intermediate=2816,
                  vocab=4096, sliding_window=512),
}

ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3", "deepseek_v32")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",  # sliding window + attention sinks + MoE (float32 only on the CPU)
    "qwen3_next": "Qwen3NextForCausalLM",  # gated-delta linear attention (ArraysCache) + attention
    "lfm2": "Lfm2ForCausalLM",  # short convolutions (ArraysCache) + attention
    "deepseek_v3": "DeepseekV3ForCausalLM",  # multi-head latent attention (MLA)
    "deepseek_v32": "DeepseekV32ForCausalLM",  # MLA + a sparse-attention indexer: CacheList per layer
}


def model_config(arch: str, size: str | Size) -> dict[str, Any]:
    """The config.json for `arch` at preset `size` (a name from SIZES or a Size)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    s = SIZES[size] if isinstance(size, str) else size
    if s.head_dim % 64:
        raise ValueError(f"head_dim must be a multiple of 64 (the 4-bit KV group size), got {s.head_dim}")
    if s.heads % s.kv_heads:
        raise ValueError(f"heads ({s.heads}) must be a multiple of kv_heads ({s.kv_heads})")
    if arch == "qwen2" and s.hidden != s.heads * s.head_dim:
        raise ValueError("qwen2 derives head_dim = hidden / heads: the size needs hidden == heads * head_dim")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": False,  # see _draw_weights
        "torch_dtype": "float32",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_IDS,
        "pad_token_id": PAD_ID,
    }
    if arch == "gemma3_text":
        config.update(
            query_pre_attn_scalar=s.head_dim,
            rope_local_base_freq=10000.0,
            sliding_window=s.sliding_window,
            # Every `pattern`-th layer is global, the rest slide; must be <= layers.
            sliding_window_pattern=min(2, s.layers),
        )
    elif arch == "gpt_oss":
        config.update(
            sliding_window=s.sliding_window, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
        )
    elif arch == "qwen3_next":
        config.update(
            linear_num_value_heads=s.heads, linear_num_key_heads=s.kv_heads, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, shared_expert_intermediate_size=s.intermediate,
            moe_intermediate_size=s.intermediate // 2, mlp_only_layers=[], partial_rotary_factor=0.25,
            full_attention_interval=2,
        )
    elif arch == "lfm2":
        config.update(
            norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=s.hidden, block_ff_dim=s.intermediate,
            block_multiple_of=64, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
        )
    elif arch in ("deepseek_v3", "deepseek_v32"):
        config.update(
            moe_intermediate_size=s.intermediate // 2, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=128,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, n_group=1, topk_group=1,
        )
        if arch == "deepseek_v32":
            # The indexer keeps its own key cache (the CacheList's second KVCache) and, past
            # index_topk cached tokens, restricts each query to its top-k keys: small here so that
            # test prompts reach the sparse path.
            config.update(index_n_heads=4, index_head_dim=64, index_topk=32)
    return config


def _draw_weights(model: Any, arch: str, seed: int) -> dict[str, Any]:
    """Fresh parameters for `model`, drawn in sorted-name order from numpy's PCG64 at `seed`.

    Embeddings N(0, 1), matrices N(0, (WEIGHT_GAIN / sqrt(fan_in))^2), biases N(0, 0.02^2), norms at
    identity. N(0, 0.02) everywhere (with tied embeddings) gives a degenerate model that repeats
    one token whatever the context; these weights make the output depend on the context, so a
    corrupted or misplaced KV cache changes it, while float rounding (prefill chunking) does not.
    The lm_head rows of the special tokens are zero: greedy decoding never picks them (no early
    EOS, every greedy run reaches max_tokens).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    # gemma's RMSNorm scales by (1 + weight), so its identity is 0.
    norm_value = 0.0 if arch.startswith("gemma") else 1.0
    weights = {}
    params = sorted(tree_flatten(model.parameters()))
    has_head = any(name == "lm_head.weight" for name, _ in params)
    for name, p in params:
        if name.endswith("norm.weight"):
            a = np.full(p.shape, norm_value, dtype=np.float32)
        else:
            if "embed_tokens" in name or name.endswith("sinks"):
                std = 1.0  # sinks of order one, so a wrong sink term changes the output
            elif p.ndim == 2:
                std = WEIGHT_GAIN / p.shape[1] ** 0.5
            else:
                std = 0.02
            a = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)
            if name == "lm_head.weight" or (name.endswith("embed_tokens.weight") and not has_head):
                a[: len(SPECIAL_TOKENS)] = 0.0  # tied embeddings (lfm2) are the output layer
        weights[name] = mx.array(a)
    return weights


def build_model(arch: str = "llama", size: str | Size = "tiny", seed: int = 0,
                overrides: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's Model for `arch` at preset `size`, weights drawn from `seed`, in float32.
    `overrides`: config.json keys set after the preset's (e.g. a layer count and pattern)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = {**model_config(arch, size), **(overrides or {})}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = _draw_weights(model, arch, seed)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, config


def _stdlib_text(cap: int = TOKENIZER_TEXT_CAP) -> str:
    """Training text: the TOKENIZER_SOURCES found in this Python's stdlib, in order, capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for rel in TOKENIZER_SOURCES:
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        chunks.append(text[: cap - total])
        total += len(chunks[-1])
        if total >= cap:
            break
    if total < 100_000:
        raise RuntimeError(
            f"found only {total} characters of Python standard library source under {root}; "
            "cannot train a tokenizer"
        )
    return "".join(chunks)


@functools.lru_cache(maxsize=None)
def train_tokenizer(vocab_size: int, added: tuple[str, ...] = ()) -> str:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, as tokenizer.json text. `added`:
    tokens given the ids after the special tokens, as added tokens that are not special (Qwen's tool
    tags: atomic in encoding, shown in decoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS) + list(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _stdlib_text()
    # Train on lines: the trainer's word counting does not depend on how the text is split.
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS + tuple(added)):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    if not added:
        return tok.to_str()
    doc = json.loads(tok.to_str())
    for entry in doc["added_tokens"]:
        if entry["content"] in added:
            entry["special"] = False
    return json.dumps(doc, ensure_ascii=False)


def tokenizer_config(clean_up_spaces: bool = False, template: str = "chatml") -> dict[str, Any]:
    """tokenizer_config.json for the trained tokenizer.

    `clean_up_spaces`: decode as a tokenizer whose config sets `clean_up_tokenization_spaces` does
    (every Llama 3.x config on the Hub): `" ,"` / `" !"` / `" 's"` lose their space. transformers
    >= 5.7 ignores that setting for BPE models unless forced, earlier versions apply it; both keys are
    written so every version decodes alike (the server's replies included).
    """
    extra = ({"clean_up_tokenization_spaces": True,
              "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
             if clean_up_spaces else {})
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": TEMPLATES[template],
        **extra,
    }


def _stamp(arch: str, size: str, seed: int, clean_up_spaces: bool = False,
           overrides: dict[str, Any] | None = None, template: str = "chatml") -> dict[str, Any]:
    stamp = {"arch": arch, "size": size, "seed": seed, "format": BUILD_FORMAT}
    if template != "chatml":  # likewise
        stamp["template"] = template
    if clean_up_spaces:  # only when set: directories built before the option stay valid
        stamp["clean_up_spaces"] = True
    if overrides:  # likewise
        stamp["overrides"] = json.loads(json.dumps(overrides, sort_keys=True))
    return stamp


def read_stamp(path: str | os.PathLike) -> dict[str, Any] | None:
    """The build stamp of a model dir written by build_model_dir, or None."""
    try:
        return json.loads((Path(path) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_built(path: Path, arch: str, size: str, seed: int, clean_up_spaces: bool = False,
              overrides: dict[str, Any] | None = None, template: str = "chatml") -> bool:
    stamp = read_stamp(path)
    want = _stamp(arch, size, seed, clean_up_spaces, overrides, template)
    if stamp is None or any(stamp.get(k) != v for k, v in want.items()) \
            or stamp.get("clean_up_spaces", False) != clean_up_spaces \
            or stamp.get("template", "chatml") != template \
            or stamp.get("overrides", {}) != want.get("overrides", {}):
        return False
    return all((path / f).is_file() for f in MODEL_FILES)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model_files(dest: Path, model: Any, config: dict[str, Any], tokenizer_json: str,
                      stamp: dict[str, Any], clean_up_spaces: bool = False, template: str = "chatml") -> None:
    """Write a servable model's files into the existing directory `dest`; the stamp goes last,
    marking the directory complete."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_text(tokenizer_json)
    _write_json(dest / "tokenizer_config.json", tokenizer_config(clean_up_spaces, template))
    _write_json(dest / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_IDS, "pad_token_id": PAD_ID})
    _write_json(dest / STAMP_FILE, stamp)
    os.chmod(dest, 0o755)  # mkdtemp makes it 0700


def move_into_place(tmp: Path, out: Path, wanted: Callable[[], bool] = lambda: False) -> None:
    """Put the finished directory `tmp` at `out`, a directory already there moved aside first and
    removed after. If another process put one there meanwhile, it is kept when `wanted()` says it is
    the one asked for; otherwise the rename's error is raised."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "model")
    try:
        os.rename(tmp, out)
    except OSError:
        if not wanted():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_model_dir(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    size: str = "small",
    seed: int = 0,
    force: bool = False,
    clean_up_spaces: bool = False,
    overrides: dict[str, Any] | None = None,
    template: str = "chatml",
) -> Path:
    """Write a servable model directory at `out_dir`; return its absolute path.

    `clean_up_spaces`: a tokenizer config that cleans up tokenization spaces (see tokenizer_config).
    `overrides`: config.json keys set over the preset's (see build_model), recorded in the stamp.
    `template`: the chat template, "chatml" (CHAT_TEMPLATE) or "qwen" (QWEN_TEMPLATE, with its tool
    tags as added tokens).

    Does nothing when `out_dir` already holds a model built with the same (arch, size, seed) unless
    `force`. Builds into a sibling temp dir and renames it into place, so a half-built directory is
    never mistaken for a model. Refuses to replace a non-empty directory it did not build.
    """
    out = Path(out_dir).expanduser().resolve()
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose from {', '.join(TEMPLATES)}")
    if not force and _is_built(out, arch, size, seed, clean_up_spaces, overrides, template):
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and read_stamp(out) is None)):
        raise FileExistsError(f"{out} exists and is not a model built by vllm-mlx-persist; not replacing it")

    model, config = build_model(arch, size, seed, overrides)
    tokenizer_json = train_tokenizer(config["vocab_size"], TOOL_TAGS if template == "qwen" else ())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        stamp = _stamp(arch, size, seed, clean_up_spaces, overrides, template)
        stamp["tokenizer_sha256"] = hashlib.sha256(tokenizer_json.encode()).hexdigest()
        write_model_files(tmp, model, config, tokenizer_json, stamp, clean_up_spaces, template)

        move_into_place(tmp, out, lambda: _is_built(out, arch, size, seed, clean_up_spaces, overrides, template))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
