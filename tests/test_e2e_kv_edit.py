"""Span directives end to end (issue #21): a real `vllm-mlx serve --cache-backend persist_q4`, the
official openai and anthropic clients. The mode's 400s; forget (output equal to a cold run of the
edited conversation, the superseded branch gone from the agent, from memory and from every block
file, and after a SIGKILL restart the unedited conversation reuses nothing past the edit); amortize
splicing (usage, never stored, the same answer as an in-process splice) and falling back with
its reason."""

from __future__ import annotations

import json
import random
import shutil
import signal
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai
import pytest

from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

MAX_TOKENS = 8
# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": 32, "hot_mb": 64, "match_text": False, "key_format": "q4"}
WORDS = "the agent reads a file then runs the tests and looks at what failed before it edits".split()


def _text(tag: str, n: int, seed: int) -> str:
    rng = random.Random(seed)
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(n))


def _tool_output(seed: int) -> str:
    """A removable span whose tokens appear nowhere else in the conversation."""
    rng = random.Random(seed)
    return "tool output: " + " ".join(f"x{rng.randrange(10**6)}" for _ in range(40))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="micro", seed=0)


def _chat(server: Server, messages: list[dict], agent: str | None = None, mode: str | None = None,
          via: str = "header"):
    kw: dict = {"extra_headers": {}, "metadata": {}}
    if agent is not None:
        kw["metadata"]["agent_id"] = agent
    if mode is not None and via == "header":
        kw["extra_headers"]["X-KV-Edit"] = mode
    elif mode is not None:
        kw["metadata"]["kv_edit"] = mode
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0.0, **{k: v for k, v in kw.items() if v})
    usage = r.usage.model_dump()
    return r.choices[0].message.content, usage


def _agent(server: Server, agent: str) -> dict:
    with urllib.request.urlopen(f"{server.url}/v1/agents/{agent}", timeout=30) as resp:
        return json.loads(resp.read())


def _stored_tokens(home: Path) -> list[list[int]]:
    root = home / ".cache" / "vllm-mlx-persist"
    out = []
    for model_dir in (p for p in root.iterdir() if (p / "blocks").is_dir()):
        store = DiskStore.open_existing(model_dir)
        out += [store.read_block(b).tokens.tolist() for b in store.iter_block_ids()]
    return out


def _holds(seq: list[int], run: list[int], k: int = 6) -> bool:
    """Whether `seq` holds any k consecutive tokens of `run`."""
    grams = {tuple(run[i:i + k]) for i in range(len(run) - k + 1)}
    return any(tuple(seq[i:i + k]) in grams for i in range(len(seq) - k + 1))


def _tokenize(model: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def test_modes_are_checked(model, tmp_path):
    with Server(model, tmp_path / "home", options=OPTIONS) as srv:
        msgs = [{"role": "user", "content": "hello"}]
        for mode, via in (("splice", "header"), ("FORGET!", "metadata")):
            with pytest.raises(openai.BadRequestError) as e:
                _chat(srv, msgs, "a", mode, via)
            assert "amortize, forget" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            _chat(srv, msgs, None, "forget")
        assert "needs an agent id" in str(e.value)
        client = anthropic.Anthropic(base_url=srv.url, api_key="test", max_retries=0, timeout=300)
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=srv.model, messages=msgs, max_tokens=4,
                                   extra_headers={"X-Agent-ID": "a", "X-KV-Edit": "nope"})
        # Anthropic via the header: served, and the report is in its usage too
        r = client.messages.create(model=srv.model, messages=msgs, max_tokens=4,
                                   extra_headers={"X-Agent-ID": "a", "X-KV-Edit": "forget"},
                                   extra_body={"temperature": 0.0})
        assert r.usage.model_dump()["kv_edit"]["mode"] == "forget"
        # Streamed, the usage chunk carries it too.
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="test", max_retries=0, timeout=300)
        chunks = list(oc.chat.completions.create(
            model=srv.model, messages=msgs, max_tokens=4, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Agent-ID": "a", "X-KV-Edit": "forget"}))
        usage = next(c.usage for c in chunks if c.usage is not None).model_dump()
        assert usage["kv_edit"]["mode"] == "forget"
        # The Responses API: metadata.kv_edit, streamed and not; a bad mode is a 400 there too.
        r = oc.responses.create(model=srv.model, input=msgs, max_output_tokens=4, temperature=0.0,
                                metadata={"agent_id": "a", "kv_edit": "amortize"})
        assert r.usage.model_dump()["kv_edit"]["mode"] == "amortize"
        with oc.responses.stream(model=srv.model, input=msgs, max_output_tokens=4, temperature=0.0,
                                 metadata={"agent_id": "a", "kv_edit": "forget"}) as stream:
            done = stream.get_final_response()
        assert done.usage.model_dump()["kv_edit"]["mode"] == "forget"
        with pytest.raises(openai.BadRequestError):
            oc.responses.create(model=srv.model, input=msgs, max_output_tokens=4,
                                metadata={"agent_id": "a", "kv_edit": "rewrite"})
        # No mode: today's usage, without a kv_edit object.
        _, usage = _chat(srv, msgs, "a")
        assert "kv_edit" not in usage


def test_forget_equals_cold_and_the_removed_span_is_gone_everywhere(model, tmp_path):
    home = tmp_path / "home"
    span = _tool_output(7)
    history = [{"role": "user", "content": _text("task", 40, 1)}]
    srv = Server(model, home, options=OPTIONS).start()
    try:
        reply, _ = _chat(srv, history, "ed")
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": span}]
        reply, _ = _chat(srv, history, "ed")
        history += [{"role": "assistant", "content": reply}]
        ask = {"role": "user", "content": _text("next", 30, 2)}
        unedited = history + [ask]
        _chat(srv, unedited, "ed")  # the history now holds the span, on disk too
        span_ids = _tokenize(model, [{"role": "user", "content": span}])
        window = span_ids[8:-8]  # the span's body, without the chat template's tokens
        assert any(_holds(t, window) for t in _stored_tokens(home)), "the span was never stored"

        # The policy drops the tool call and its result: everything from history[1] on, but the ask.
        edited = history[:1] + [ask]
        text, usage = _chat(srv, edited, "ed", "forget")
        cold, cold_usage = _chat(srv, edited, "cold-reference")
        assert text == cold, srv.log_tail()
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
        edit_at = next(i for i, (a, b) in enumerate(zip(_tokenize(model, unedited), _tokenize(model, edited)))
                       if a != b)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        report = usage["kv_edit"]
        assert report["mode"] == "forget" and report["applied"] is True and report["superseded_branches"] >= 1
        assert report["exact_prefix_tokens"] == cached <= edit_at and report["spliced_tokens"] == 0
        assert report["recomputed_tokens"] == usage["prompt_tokens"] - cached and report["fallback"] is None

        info = _agent(srv, "ed")
        assert len(info["branches"]) == 1, info  # the superseded branch left the agent
        for t in _stored_tokens(home):
            assert not _holds(t, window), "a block file still holds the removed span"

        srv.restart(signal.SIGKILL)  # right after the response completed
        _, again = _chat(srv, unedited, "ed")
        assert again["prompt_tokens_details"]["cached_tokens"] <= edit_at, srv.log_tail()
    finally:
        srv.stop()


def _reference_splice(model: Path, cache_root: Path, agent: str, ids: list[int], options: dict = OPTIONS,
                      ) -> tuple[str, int]:
    """The same amortize request served in this process from a copy of the server's cache: the
    backend's own fetch (the splice), then greedy decoding on the spliced cache. (text, cached)."""
    import mlx.core as mx
    from mlx_lm import load

    from vllm_mlx_persist.backend import PersistQ4Backend

    m, tok = load(str(model))
    backend = PersistQ4Backend(model=m, tokenizer=tok, options={**options, "cache_dir": str(cache_root),
                                                                "warmup": False, "restore": False})
    try:
        backend.load()
        req = SimpleNamespace(prompt_token_ids=ids, cache_namespace=f"{agent}\0edit:amortize", request_id="ref")
        hit = backend.fetch(req)
        assert hit is not None and req.cache_usage["kv_edit"]["applied"]
        cache, out = hit.cache, []
        logits = m(mx.array([ids[hit.num_tokens:]]), cache=cache)[:, -1]
        eos = set(tok.eos_token_ids) if hasattr(tok, "eos_token_ids") else {tok.eos_token_id}
        for _ in range(MAX_TOKENS):
            t = mx.argmax(logits, axis=-1).item()
            if t in eos:
                break
            out.append(t)
            logits = m(mx.array([[t]]), cache=cache)[:, -1]
        backend.on_request_finished(req, False)
        return tok.decode(out), hit.cached_tokens
    finally:
        backend.close()


def test_amortize_splices_and_an_exact_request_never_sees_it(model, tmp_path):
    """A tool output replaced by a stub, the later messages unchanged: the stub is prefilled, the later
    messages' stored K/V are spliced with their keys moved, and usage says so (cached_tokens counts
    the exact prefix and the run, never the stub). The answer equals the same splice run in process.
    The spliced turn is stored apart: the agent's branches are unchanged, and a plain request for the
    same messages reuses only the exact prefix and answers what a cold agent answers. An edit after
    which nothing stored reappears says no_realignment and is served as exact."""
    home = tmp_path / "home"
    with Server(model, home, options={**OPTIONS, "kv_edit": {"enabled": True}}) as srv:
        history = [{"role": "user", "content": _text("task", 40, 3)}]
        reply, _ = _chat(srv, history, "am")
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": _tool_output(9)}]
        reply, _ = _chat(srv, history, "am")
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": _text("then", 40, 5)}]
        reply, _ = _chat(srv, history, "am")
        ask = {"role": "user", "content": _text("next", 20, 4)}
        stubbed = history[:2] + [{"role": "user", "content": "tool output: (truncated)"}] + history[3:] \
            + [{"role": "assistant", "content": reply}, ask]
        branches = _agent(srv, "am")["branches"]
        copy = tmp_path / "copy"  # the history as the splice sees it, for the in-process reference
        shutil.copytree(home / ".cache" / "vllm-mlx-persist", copy, ignore=shutil.ignore_patterns(".lock"))
        text, usage = _chat(srv, stubbed, "am", "amortize", via="metadata")
        report = usage["kv_edit"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert report["mode"] == "amortize" and report["applied"] is True and report["fallback"] is None, report
        assert report["spliced_tokens"] >= 16 and report["plan"][0]["delta"] < 0  # the stub is shorter
        assert cached == report["exact_prefix_tokens"] + report["spliced_tokens"]
        assert report["recomputed_tokens"] == usage["prompt_tokens"] - cached
        n_prompt = usage["prompt_tokens"]
        assert _agent(srv, "am")["branches"] == branches  # stored apart: the agent's history is unchanged

        exact_text, exact = _chat(srv, stubbed, "am")
        assert exact["prompt_tokens_details"]["cached_tokens"] <= report["exact_prefix_tokens"] + 1
        assert exact_text == _chat(srv, stubbed, "am-cold")[0]

        # a new question right after the task: nothing stored after the edit reappears (the old `ask`
        # would: its text starts a line, which the spliced history holds)
        _, usage = _chat(srv, history[:1] + [{"role": "user", "content": _text("other", 20, 8)}], "am", "amortize")
        assert usage["kv_edit"]["fallback"] == "no_realignment" and usage["kv_edit"]["applied"] is False, usage["kv_edit"]
        assert "min_run_tokens" in usage["kv_edit"]["detail"]
    ids = _tokenize(model, stubbed)
    assert len(ids) == n_prompt  # the server's prompt, tokenized here
    ref_text, ref_cached = _reference_splice(model, copy, "am", ids)
    assert ref_cached == cached
    assert ref_text.strip() == text.strip()


def _conversation(srv: Server, agent: str) -> tuple[list[dict], list[dict]]:
    """Three turns with a tool output in the middle; returns (history, the same with the tool output
    replaced by a stub and a new question)."""
    history = [{"role": "user", "content": _text("task", 40, 3)}]
    reply, _ = _chat(srv, history, agent)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": _tool_output(9)}]
    reply, _ = _chat(srv, history, agent)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": _text("then", 40, 5)}]
    reply, _ = _chat(srv, history, agent)
    stubbed = history[:2] + [{"role": "user", "content": "tool output: (truncated)"}] + history[3:] \
        + [{"role": "assistant", "content": reply}, {"role": "user", "content": _text("next", 20, 4)}]
    return history, stubbed


FALLBACK = {"qwen3_next": "recurrent_state", "lfm2": "recurrent_state"}
# gemma3_text's window shorter than the run (~120 tokens), gpt_oss's (128) longer: the sliding layers
# get their window from the run alone, or from the stub's cache and the whole run.
OVERRIDES = {"gemma3_text": {"sliding_window": 64}}


@pytest.mark.parametrize("arch,latent_bits", [("deepseek_v3", None), ("deepseek_v3", 4), ("deepseek_v32", None),
                                              ("qwen3_next", None), ("lfm2", None), ("gemma3_text", None),
                                              ("gpt_oss", None)])
def test_families_splice_or_fall_back_with_their_reason(tmp_path, arch, latent_bits):
    """MLA models (latents in full precision or packed in 4 bits) and sliding-window models splice,
    each answering what the in-process splice answers; recurrent hybrids fall back with
    recurrent_state and answer what a cold agent answers."""
    model = build_model_dir(tmp_path / "model", arch=arch, size="tiny", seed=0, overrides=OVERRIDES.get(arch))
    home = tmp_path / "home"
    options = {**OPTIONS, "latent_bits": latent_bits}
    with Server(model, home, options=options) as srv:
        _, stubbed = _conversation(srv, "fam")
        copy = tmp_path / "copy"  # the history as the splice sees it, for the in-process reference
        shutil.copytree(home / ".cache" / "vllm-mlx-persist", copy, ignore=shutil.ignore_patterns(".lock"))
        text, usage = _chat(srv, stubbed, "fam", "amortize")
        report = usage["kv_edit"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if arch in FALLBACK:
            assert report["applied"] is False and report["fallback"] == FALLBACK[arch], report
            assert cached == report["exact_prefix_tokens"]
            assert text == _chat(srv, stubbed, "fam-cold")[0]
            return
        assert report["applied"] is True and cached == report["exact_prefix_tokens"] + report["spliced_tokens"]
    ref_text, ref_cached = _reference_splice(model, copy, "fam", _tokenize(model, stubbed), options)
    assert ref_cached == cached and ref_text.strip() == text.strip()


def _persisted_run(model: Path, home: Path, kill: bool) -> tuple:
    """Splice, optionally SIGKILL and restart, then continue the spliced history (amortize), and
    check that exact requests and a fork that did not opt in never reuse spliced K/V."""
    srv = Server(model, home, options=OPTIONS).start()
    try:
        _, stubbed = _conversation(srv, "p")
        text, usage = _chat(srv, stubbed, "p", "amortize")
        first = usage["kv_edit"]
        assert first["applied"] is True and first["fallback"] is None, first
        if kill:
            srv.restart(signal.SIGKILL)  # right after the spliced turn's response completed
        cont = stubbed + [{"role": "assistant", "content": text}, {"role": "user", "content": _text("more", 10, 6)}]
        text2, usage2 = _chat(srv, cont, "p", "amortize")
        second, cached2 = usage2["kv_edit"], usage2["prompt_tokens_details"]["cached_tokens"]
        assert second["applied"] is True and cached2 >= usage["prompt_tokens"], (second, cached2)
        assert second["spliced_tokens"] > 0 and cached2 == second["exact_prefix_tokens"] + second["spliced_tokens"]
        # A fork that did not opt in, then the agent itself without a mode: the honest history only
        # (each stores an honest turn of its own, so the fork goes first).
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="test", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=srv.model, messages=cont, max_tokens=MAX_TOKENS, temperature=0.0,
                                           metadata={"agent_id": "p-fork", "fork_from": "p"})
        assert r.usage.prompt_tokens_details.cached_tokens <= first["exact_prefix_tokens"] + 1
        _, exact = _chat(srv, cont, "p")
        assert exact["prompt_tokens_details"]["cached_tokens"] <= first["exact_prefix_tokens"] + 1
        # Erasing the agent erases its spliced history too (the fork keeps only what it shares).
        req = urllib.request.Request(f"{srv.url}/v1/agents/p", method="DELETE")
        urllib.request.urlopen(req, timeout=30).read()
        req = urllib.request.Request(f"{srv.url}/v1/agents/p-fork", method="DELETE")
        urllib.request.urlopen(req, timeout=30).read()
        assert _stored_tokens(home) == [], "an erased agent's spliced history is still on disk"
        return text, text2, cached2, second
    finally:
        srv.stop()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_spliced_history_survives_sigkill_and_stays_what_the_hot_path_gives(model, tmp_path, arch):
    if arch != "llama":  # sliding windows: the spliced turn's blocks hold its layers' last window only
        model = build_model_dir(tmp_path / "model", arch=arch, size="tiny", seed=0, overrides=OVERRIDES.get(arch))
    hot = _persisted_run(model, tmp_path / "hot", kill=False)
    killed = _persisted_run(model, tmp_path / "killed", kill=True)
    assert killed == hot


def test_two_edits_in_one_request_are_two_splices(model, tmp_path):
    home = tmp_path / "home"
    with Server(model, home, options=OPTIONS) as srv:
        history = [{"role": "user", "content": _text("task", 40, 3)}]
        for i, content in enumerate([_tool_output(9), _text("then", 40, 5), _tool_output(11), _text("and", 40, 12)]):
            reply, _ = _chat(srv, history, "two")
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": content}]
        reply, _ = _chat(srv, history, "two")
        stub = {"role": "user", "content": "tool output: (truncated)"}
        edited = history[:2] + [stub] + history[3:6] + [stub] + history[7:] \
            + [{"role": "assistant", "content": reply}, {"role": "user", "content": _text("next", 20, 4)}]
        copy = tmp_path / "copy"
        shutil.copytree(home / ".cache" / "vllm-mlx-persist", copy, ignore=shutil.ignore_patterns(".lock"))
        text, usage = _chat(srv, edited, "two", "amortize")
        report = usage["kv_edit"]
        assert report["applied"] is True and len(report["plan"]) >= 2, report
        assert usage["prompt_tokens_details"]["cached_tokens"] == report["exact_prefix_tokens"] + report["spliced_tokens"]
    ref_text, ref_cached = _reference_splice(model, copy, "two", _tokenize(model, edited))
    assert ref_cached == usage["prompt_tokens_details"]["cached_tokens"] and ref_text.strip() == text.strip()


def test_amortize_switched_off_is_exact(model, tmp_path):
    """kv_edit.enabled false: an amortize request is served and stored as an exact one (disabled),
    and never sees a spliced history."""
    with Server(model, tmp_path / "home", options={**OPTIONS, "kv_edit": {"enabled": False}}) as srv:
        _, stubbed = _conversation(srv, "off")
        text, usage = _chat(srv, stubbed, "off", "amortize")
        report = usage["kv_edit"]
        assert report["applied"] is False and report["fallback"] == "disabled" and report["spliced_tokens"] == 0
        assert usage["prompt_tokens_details"]["cached_tokens"] == report["exact_prefix_tokens"]
        assert text == _chat(srv, stubbed, "off-cold")[0]
        assert len(_agent(srv, "off")["branches"]) >= 2  # stored as the agent's own (exact) turn


def test_concurrent_edits_of_one_agent_stay_honest(model, tmp_path):
    """Two amortize edits and a forget edit of one agent at once, with another agent's turn: every
    request is answered with a consistent report; afterwards an exact request of each edited
    conversation answers what a cold agent answers (no spliced K/V leaked into an honest history,
    whichever order the edits committed in), and after a SIGKILL restart the amortize edit is served
    again with a consistent report."""
    from concurrent.futures import ThreadPoolExecutor

    home = tmp_path / "home"
    with Server(model, home, options=OPTIONS) as srv:
        history = [{"role": "user", "content": _text("task", 30, 3)}]
        for content in (_tool_output(9), _text("then", 30, 5), _tool_output(11), _text("and", 30, 12)):
            reply, _ = _chat(srv, history, "cc")
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": content}]
        stub = {"role": "user", "content": "tool output: (truncated)"}
        ask = {"role": "user", "content": _text("next", 12, 4)}
        edits = {"amortize-1": (history[:2] + [stub] + history[3:] + [ask], "amortize"),
                 "amortize-2": (history[:6] + [stub] + history[7:] + [ask], "amortize"),
                 "forget-1": (history[:2] + [stub] + history[3:] + [ask, ask], "forget")}
        with ThreadPoolExecutor(4) as ex:
            futures = {name: ex.submit(_chat, srv, msgs, "cc", mode) for name, (msgs, mode) in edits.items()}
            other = ex.submit(_chat, srv, history, "other")
            results = {name: f.result() for name, f in futures.items()}
            other.result()
        for name, (_, usage) in results.items():
            report, cached = usage["kv_edit"], usage["prompt_tokens_details"]["cached_tokens"]
            assert report["mode"] == edits[name][1], report
            assert cached == report["exact_prefix_tokens"] + report["spliced_tokens"], (name, report, cached)
            assert report["recomputed_tokens"] == usage["prompt_tokens"] - cached, (name, report)
        for name, (msgs, _) in edits.items():  # exact requests: only honest K/V, whatever was stored
            assert _chat(srv, msgs, "cc")[0] == _chat(srv, msgs, f"cold-{name}")[0], (name, srv.log_tail())
        srv.restart(signal.SIGKILL)
        _, usage = _chat(srv, edits["amortize-2"][0], "cc", "amortize")
        report = usage["kv_edit"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == report["exact_prefix_tokens"] + report["spliced_tokens"]
        with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
            assert r.status == 200
