"""Matching by text never changes what the model reads, at pool level with the backend's own decode.

When a prompt's tokens differ from an agent's stored tokens but decode to the same text, the pool
serves the request as the stored tokens (tests/test_sharing.py). That is only sound if "the same
text" is exact: the served tokens must give the model the client's text byte for byte, with the same
control tokens. A tokenizer's `decode` is made for display and loses that in several ways; each test
here builds one such case with a real tokenizer and checks what the model would be fed (`fed`: the
UTF-8 bytes of ordinary tokens, added tokens by id) against the client's text as tokenized cold.
End to end through a server: tests/test_e2e_text_match.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from test_pool import COLD_HOT_TOL, prefill
from vllm_mlx_persist.backend import PersistQ4Backend
from vllm_mlx_persist.tools.models.build import build_model, build_model_dir

FILL = ("the cache keeps what the agent has read so that a returning agent only prefills what is new "
        "while every other agent keeps its own memory ")
# " !" and " !=" are single tokens of the test vocabulary; clean-up turns them into "!" and "!=".
SPACED = "wow ! so x != y ! OK"
CLEAN = "wow! so x!= y! OK"


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """mlx-lm's TokenizerWrapper over a tokenizer whose config cleans up tokenization spaces."""
    from mlx_lm.tokenizer_utils import load

    path = build_model_dir(tmp_path_factory.mktemp("m") / "llama", "llama", "tiny", 0, clean_up_spaces=True)
    return load(path)


@pytest.fixture
def backend(model, tok, tmp_path):
    b = PersistQ4Backend(model=model, tokenizer=tok, options={
        "cache_dir": str(tmp_path), "block_size": 16, "warmup": False, "restore": False,
        "key_format": "q4"})  # auto's choice on this model, without calibrating
    yield b
    b.close()


def byte_decoder() -> dict[str, int]:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    BPEStreamingDetokenizer.make_byte_decoder()
    return BPEStreamingDetokenizer._byte_decoder


def fed(tok, ids: list[int]) -> list:
    """What the model reads from `ids` (byte-level BPE): runs of UTF-8 bytes, added tokens by id."""
    hf = tok._tokenizer
    added, bmap, out, buf = set(hf.added_tokens_decoder), byte_decoder(), [], bytearray()
    for t in ids:
        if t in added:
            if buf:
                out.append(bytes(buf))
                buf = bytearray()
            out.append(int(t))
        else:
            buf += bytes(bmap[c] for c in hf.convert_ids_to_tokens(int(t)))
    if buf:
        out.append(bytes(buf))
    return out


def serve(backend, model, agent: str, prompt: list[int]) -> tuple[list[int], int]:
    """Look `prompt` up as the engine does, run what is left and commit the turn; returns
    (the tokens the model was fed, tokens reused)."""
    m = backend.pool.match(agent, prompt)
    served = m.prompt if m.prompt is not None else list(prompt)
    if m.num_tokens:
        cache, hot = prefill(model, served[m.num_tokens:], m.cache)
        _, cold = prefill(model, served)
        assert mx.abs(hot - cold).max().item() < COLD_HOT_TOL
    else:
        cache, _ = prefill(model, served)
    backend.pool.commit(agent, served, cache)
    return served, m.num_tokens


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_clean_up_of_tokenization_spaces_never_hides_an_edit(backend, model, tok):
    """Regression: the tokenizer config sets clean_up_tokenization_spaces, so `" !"` and `"!"`
    decoded alike and the edited prompt was served as the stored tokens: the client sent
    'wow! so x!= y! OK', the model was fed 'wow ! so x != y ! OK'."""
    assert tok.decode(encode(tok, SPACED)) == CLEAN  # the tokenizer's own decode hides the spaces
    first = FILL + SPACED + " " + FILL
    serve(backend, model, "a", encode(tok, first))
    edited = FILL + CLEAN + " " + FILL + "and then some more"
    served, reused = serve(backend, model, "a", encode(tok, edited))
    assert fed(tok, served) == fed(tok, encode(tok, edited)) == [edited.encode()]
    edit_at = len(encode(tok, FILL + "wow"))
    assert reused >= edit_at - 1  # what precedes the edit is still reused


def test_a_replacement_character_only_matches_itself(backend, model, tok):
    """A reply holding bytes that are not UTF-8 shows the client U+FFFD; the client replays that
    character (bytes EF BF BD). Both decode to U+FFFD: the replay was served as the invalid bytes."""
    bmap = {v: k for k, v in byte_decoder().items()}
    lone = tok._tokenizer.convert_tokens_to_ids(bmap[0x80])  # a continuation byte on its own
    head, tail = FILL + "reply", " the rest of the reply and " + FILL
    serve(backend, model, "a", encode(tok, head) + [lone] + encode(tok, tail))
    assert tok.decode([lone]) == "\ufffd"
    replay = head + "\ufffd" + tail + "next question"
    served, reused = serve(backend, model, "a", encode(tok, replay))
    assert fed(tok, served) == [replay.encode()]
    assert reused >= len(encode(tok, head)) - 1


def test_a_special_token_only_matches_itself(backend, model, tok):
    """A reply that spells '<|im_end|>' in ordinary tokens decodes like the control token the
    client's replay of that text tokenizes to; the model must read the control token, as cold."""
    spelled = encode(tok, "<|im") + encode(tok, "_end|>")
    im_end = tok._tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in spelled and tok.decode(spelled) == "<|im_end|>"
    head, tail = FILL + "reply", " the rest of the reply and " + FILL
    serve(backend, model, "a", encode(tok, head) + spelled + encode(tok, tail))
    replay = head + "<|im_end|>" + tail + "next question"
    cold = encode(tok, replay)
    assert im_end in cold
    served, _ = serve(backend, model, "a", cold)
    assert fed(tok, served) == fed(tok, cold)


def test_a_retokenized_stretch_is_still_matched_and_fed_exactly(backend, model, tok):
    """What matching is for: the same text tokenized another way (here split inside a word, as a
    generated reply may be) is reused past the difference and fed byte for byte."""
    head, reply, tail = FILL, "so the agent keeps its memory", " and " + FILL
    cut = next(i for i in range(1, len(reply)) if encode(tok, reply[:i]) + encode(tok, reply[i:]) != encode(tok, reply))
    split = encode(tok, reply[:cut]) + encode(tok, reply[cut:])
    stored = encode(tok, head) + split + encode(tok, tail)
    serve(backend, model, "a", stored)
    client = head + reply + tail + "next question"
    served, reused = serve(backend, model, "a", encode(tok, client))
    assert fed(tok, served) == [client.encode()]
    assert backend.pool.stats["text_matches"] == 1 and reused == len(stored) - 1  # its trailing " " differs


def test_matching_goes_on_when_decoding_starts_inside_a_character(backend, model, tok):
    """The matcher decodes from a few tokens before the difference; when that cuts a character
    (multi-byte text in byte tokens), the cut bytes compare by token id and the match goes on."""
    from vllm_mlx_persist.text_match import TEXT_MATCH_CONTEXT

    reply, tail = "so the agent keeps its memory", " and " + FILL
    cut = next(i for i in range(1, len(reply)) if encode(tok, reply[:i]) + encode(tok, reply[i:]) != encode(tok, reply))
    split = encode(tok, reply[:cut]) + encode(tok, reply[cut:])
    d = next(i for i, (a, b) in enumerate(zip(split, encode(tok, reply))) if a != b)
    for n in range(2, 8):  # CJK characters (three byte tokens each) before the reply
        head = FILL + "中" * n + " "
        k = len(encode(tok, head)) + d
        stored = encode(tok, head) + split + encode(tok, tail)
        if tok.decode(stored[k - TEXT_MATCH_CONTEXT : k]).startswith("\ufffd"):
            break
    else:
        pytest.fail("no cut inside a character")
    serve(backend, model, "a", stored)
    client = head + reply + tail + "next question"
    served, reused = serve(backend, model, "a", encode(tok, client))
    assert fed(tok, served) == [client.encode()]
    assert backend.pool.stats["text_matches"] == 1 and reused == len(stored) - 1


def _metaspace_tokenizer(vocab_size: int):
    """A SentencePiece-style tokenizer (BPE + Metaspace): its decoder drops the leading space of
    the sequence's first token, as Llama 2's and Gemma's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vllm_mlx_persist.tools.models.build import SPECIAL_TOKENS, _stdlib_text

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    t.train_from_iterator(_stdlib_text(300_000).splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t)


def test_the_first_tokens_leading_space_is_not_lost(model, tmp_path):
    """With a Metaspace decoder '▁the' and 'the' decode alike at the start of a sequence, so a
    prompt differing from the stored tokens in its very first token was served as them."""
    tok = _metaspace_tokenizer(1000)
    b = PersistQ4Backend(model=model, tokenizer=tok, options={
        "cache_dir": str(tmp_path), "block_size": 16, "warmup": False, "restore": False,
        "key_format": "q4"})  # auto's choice on this model, without calibrating
    try:
        rest = tok.encode(" cache keeps what the agent has read so that a returning agent only", add_special_tokens=False)
        spaced, bare = tok.convert_tokens_to_ids("▁the"), tok.convert_tokens_to_ids("the")
        assert None not in (spaced, bare) and tok.decode([spaced]) == tok.decode([bare])
        serve(b, model, "a", [spaced] + rest)
        served, reused = serve(b, model, "a", [bare] + rest + rest)
        assert served[0] == bare and reused == 0
    finally:
        b.close()


def test_a_wordpiece_decoders_own_clean_up_is_off(model, tmp_path):
    """WordPiece decoders clean up spaces themselves (below transformers' clean_up_tokenization_spaces):
    'hello' ',' and 'hello' '##,' both decoded to 'hello,'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "##,": 3, "world": 4}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece(cleanup=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, clean_up_tokenization_spaces=False)
    assert tok.decode([1, 2, 4]) == tok.decode([1, 3, 4]) == "hello, world"
    b = PersistQ4Backend(model=model, tokenizer=tok, options={"cache_dir": str(tmp_path), "warmup": False})
    try:
        assert b._decode([1, 2, 4]) != b._decode([1, 3, 4])
        assert b._decode([1, 2, 4]).strip() == "hello , world"
    finally:
        b.close()


def test_the_server_model_config_sets_clean_up(tok):
    """The fixture is what it says: the config asks for clean-up and this transformers honours it."""
    path = tok._tokenizer.name_or_path
    cfg = json.loads(open(f"{path}/tokenizer_config.json").read())
    assert cfg["clean_up_tokenization_spaces"] is True
    assert tok.decode(encode(tok, "x != y")) == "x!= y"


def test_an_amortize_edit_is_spliced_onto_a_history_matched_by_text(backend, model, tok):
    """A reply stored tokenized another way, then a later message replaced (amortize): the lookup
    matches the reply by text and the splice is planned and executed on the prompt as served (the
    stored tokens), which feeds the model the client's bytes; the spliced layer-0 keys (token and
    position only) equal a cold prefill's of that prompt to 4-bit precision."""
    from types import SimpleNamespace

    from vllm_mlx_persist.kv_edit.plan import message_anchor

    A = message_anchor(tok)
    reply = "so the agent keeps its memory"
    cut = next(i for i in range(1, len(reply)) if encode(tok, reply[:i]) + encode(tok, reply[i:]) != encode(tok, reply))
    head, tool, tail = [A] + encode(tok, FILL), [A] + encode(tok, "tool output " * 12), [A] + encode(tok, FILL * 2)
    stored = head + [A] + encode(tok, reply[:cut]) + encode(tok, reply[cut:]) + tool + tail
    serve(backend, model, "a", stored)
    client = head + [A] + encode(tok, reply) + [A] + encode(tok, "stub") + tail + encode(tok, "next")
    req = SimpleNamespace(prompt_token_ids=client, cache_namespace="a\0edit:amortize", request_id="r")
    hit = backend.fetch(req)
    report = req.cache_usage["kv_edit"]
    assert report["applied"] and report["fallback"] is None and report["plan"], report
    served = hit.prompt_token_ids
    assert served is not None and fed(tok, served) == fed(tok, client)
    assert hit.cached_tokens == report["exact_prefix_tokens"] + report["spliced_tokens"]
    assert report["recomputed_tokens"] == len(served) - hit.cached_tokens
    codec = backend.codec
    cold = codec.make_cache()
    mx.eval(model(mx.array([served[:hit.num_tokens]]), cache=cold))
    got, ref = codec.token_arrays(hit.cache), codec.token_arrays(cold)
    deq = lambda a: mx.dequantize(*(a[f"0.k.{p}"] for p in "qsb"), codec.group_size, codec.bits)  # noqa: E731
    step = mx.abs(ref["0.k.s"].astype(mx.float32)).max().item()
    assert mx.abs(deq(got) - deq(ref)).max().item() <= 2 * step
    backend.on_request_finished(req, False)
