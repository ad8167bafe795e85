"""Amortize on the conversations agents send (issue #32), end to end: a real `vllm-mlx serve
--cache-backend persist_q4` and the official openai and anthropic clients, one server per template
for the whole module.

Each shape: the agent's previous turn sent the unedited conversation (the server stored it), then
the same conversation with a long tool output (or argument) replaced by a short stub is sent with
`X-KV-Edit: amortize` and again without a mode (exact). Amortize must report `applied: true`,
splice the stored text after the edit (cached tokens well above the exact request's, only the stub
and a few tokens around it prefilled), and exact must reuse only the prefix before the edit.

* ChatML (vllm-mlx's default tool format: role "tool" becomes a user message `[Tool Result (id)]: ...`,
  tool calls become `[Calling tool: ...]` text, and consecutive same-role messages are merged into one
  joined by a blank line): consecutive user messages, one tool message, several in a row, an
  assistant's tool-call argument, Anthropic tool_result blocks (one and several in one user
  message), Responses API input items, two edits in one request; an edit that cannot splice says why.
* Qwen 2.5's template served with a native tool parser (`--enable-auto-tool-choice
  --tool-call-parser hermes`): consecutive tool results inside one user turn as <tool_response>
  blocks (OpenAI tool messages, Anthropic tool_result blocks, Responses function_call_output items),
  and an assistant's <tool_call> argument.
"""

from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

MAX_TOKENS = 4
# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": 32, "hot_mb": 64, "match_text": False, "key_format": "q4"}
NATIVE_TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
STUB = "[output truncated]"


def _lines(seed: int, n: int) -> str:
    """A tool output: n lines of grep-like hits, tokens that appear nowhere else."""
    rng = random.Random(seed)
    return "\n".join(f"src/m{rng.randrange(99)}.py:{rng.randrange(900)}: " + " ".join(
        f"v{rng.randrange(10 ** 5)}" for _ in range(5)) for _ in range(n))


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = "the agent reads a file then runs the tests and looks at what failed before it edits".split()
    return " ".join(rng.choice(words) for _ in range(n))


LONG, LONG2 = _lines(1, 8), _lines(2, 8)  # ~340 tokens each, a stub of ~10 replaces them
KEPT = _lines(3, 6)  # a tool output kept as it is
TASK = {"role": "user", "content": "Fix the failing parser test. " + _words(4, 30)}
NOTE = "Note: the tests live under tests/parser and use the fixtures of conftest.py; " + _words(5, 30)


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"chatml": server, "qwen": server with a native tool parser}, up for the whole module."""
    root = tmp_path_factory.mktemp("shapes")
    out = {}
    try:
        for name, args in (("chatml", ()), ("qwen", NATIVE_TOOLS)):
            model = build_model_dir(root / f"model-{name}", arch="llama", size="micro", seed=0, template=name)
            out[name] = Server(model, root / f"home-{name}", options=OPTIONS, extra_args=args).start()
        yield out
    finally:
        for srv in out.values():
            srv.stop()


def _headers(agent: str, mode: str | None) -> dict:
    return {"X-Agent-ID": agent, **({"X-KV-Edit": mode} if mode else {})}


def chat(srv: Server, messages: list[dict], agent: str, mode: str | None = None) -> dict:
    """usage of a chat completion, with `cached` (prompt_tokens_details.cached_tokens) and `prompt`."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="test", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=srv.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_headers=_headers(agent, mode))
    u = r.usage.model_dump()
    return {**u, "cached": u["prompt_tokens_details"]["cached_tokens"], "prompt": u["prompt_tokens"]}


def messages(srv: Server, msgs: list[dict], agent: str, mode: str | None = None) -> dict:
    """usage of an Anthropic Messages request, with `cached` (cache_read_input_tokens) and `prompt`."""
    client = anthropic.Anthropic(base_url=srv.url, api_key="test", max_retries=0, timeout=300)
    r = client.messages.create(model=srv.model, messages=msgs, max_tokens=MAX_TOKENS, system="You are a coding agent.",
                               extra_headers=_headers(agent, mode), extra_body={"temperature": 0.0})
    u = r.usage.model_dump()
    return {**u, "cached": u["cache_read_input_tokens"], "prompt": u["input_tokens"] + u["cache_read_input_tokens"]}


def responses(srv: Server, items: list[dict], agent: str, mode: str | None = None) -> dict:
    """usage of a Responses API request, with `cached` and `prompt`."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="test", max_retries=0, timeout=300)
    r = client.responses.create(model=srv.model, input=items, max_output_tokens=MAX_TOKENS, temperature=0.0,
                                extra_headers=_headers(agent, mode))
    u = r.usage.model_dump()
    return {**u, "cached": u["input_tokens_details"]["cached_tokens"], "prompt": u["input_tokens"]}


def _splices(send, srv: Server, unedited, edited, agent: str, edits: int = 1, boundary: str | None = None) -> dict:
    """The previous turn stores `unedited`; `edited` is sent with amortize, then exact. Amortize splices
    the stored text after each edit and prefills little else; exact reuses only the prefix."""
    send(srv, unedited, agent)
    am = send(srv, edited, agent, "amortize")
    ex = send(srv, edited, agent)
    report = am["kv_edit"]
    assert report["applied"] is True and report["fallback"] is None, (report, srv.log_tail())
    assert len(report["plan"]) == edits, report
    assert am["cached"] == report["exact_prefix_tokens"] + report["spliced_tokens"]
    assert ex["cached"] <= report["exact_prefix_tokens"] + 1 and "kv_edit" not in ex
    after = am["prompt"] - ex["cached"]  # what exact prefills: everything after the edit
    assert after >= 100, (am, ex)
    # amortize prefills the stubs, the few tokens around each point and the prompt's last token
    assert report["recomputed_tokens"] <= 20 * edits, report
    assert am["cached"] - ex["cached"] >= after - 20 * edits
    if boundary is not None:
        assert [p["boundary"] for p in report["plan"]] == [boundary] * edits, report
    print(f"\n[shape] {agent}: prompt {am['prompt']}, cached amortize {am['cached']} / exact {ex['cached']}, "
          f"prefilled {report['recomputed_tokens']} / {am['prompt'] - ex['cached']}, applied {report['applied']}, "
          f"fallback {report['fallback']}, plan {report['plan']}")
    return report


# ---- ChatML, vllm-mlx's default tool format ------------------------------------------------------


def test_consecutive_user_messages(servers):
    """The issue's shape: a tool output as a user message, then another user message (merged into one
    with a blank line by vllm-mlx); the output stubbed."""
    conv = lambda out: [{"role": "system", "content": "You are a coding agent."}, TASK,  # noqa: E731
                        {"role": "assistant", "content": "Let me grep for it."},
                        {"role": "user", "content": out}, {"role": "user", "content": NOTE}]
    _splices(chat, servers["chatml"], conv(LONG), conv(STUB), "merged", boundary="line")


def test_one_tool_message(servers):
    conv = lambda out: [TASK, {"role": "assistant", "content": "", "tool_calls": [_call(1, "grep", {"q": "parse"})]},  # noqa: E731
                        {"role": "tool", "tool_call_id": "call_1", "content": out},
                        {"role": "assistant", "content": "The hits are in the tokenizer; " + _words(6, 20)},
                        {"role": "user", "content": NOTE}]
    _splices(chat, servers["chatml"], conv(LONG), conv(STUB), "tool-one")


def test_tool_messages_in_a_row(servers):
    """Three tool results in a row (one user message once merged); the first stubbed."""
    calls = [_call(i, "read_file", {"path": f"src/m{i}.py"}) for i in (1, 2, 3)]
    conv = lambda out: [TASK, {"role": "assistant", "content": "", "tool_calls": calls},  # noqa: E731
                        {"role": "tool", "tool_call_id": "call_1", "content": out},
                        {"role": "tool", "tool_call_id": "call_2", "content": KEPT},
                        {"role": "tool", "tool_call_id": "call_3", "content": _lines(7, 6)}]
    _splices(chat, servers["chatml"], conv(LONG), conv(STUB), "tool-row", boundary="line")


def _write_then_run(text: str, said: str) -> list[dict]:
    """The task, an assistant turn saying `said` that writes `text` (the argument a harness cuts) and runs
    the tests, both calls' results, and a note."""
    return [TASK, {"role": "assistant", "content": said, "tool_calls": [
        _call(1, "write_file", {"path": "src/parser.py", "text": text}), _call(2, "run", {"cmd": "pytest -x"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "written"},
        {"role": "tool", "tool_call_id": "call_2", "content": KEPT}, {"role": "user", "content": NOTE}]


def test_an_assistant_tool_call_argument(servers):
    """A long write_file argument in the first of two calls, cut by the harness."""
    said = "Writing the fix."
    _splices(chat, servers["chatml"], _write_then_run(LONG, said), _write_then_run(STUB, said), "tool-arg",
             boundary="line")


def test_two_edits_in_one_request(servers):
    calls = [_call(i, "read_file", {"path": f"src/m{i}.py"}) for i in (1, 2, 3)]
    conv = lambda a, b: [TASK, {"role": "assistant", "content": "", "tool_calls": calls},  # noqa: E731
                         {"role": "tool", "tool_call_id": "call_1", "content": a},
                         {"role": "tool", "tool_call_id": "call_2", "content": KEPT},
                         {"role": "tool", "tool_call_id": "call_3", "content": b}, {"role": "user", "content": NOTE}]
    _splices(chat, servers["chatml"], conv(LONG, LONG2), conv(STUB, STUB), "two-edits", edits=2, boundary="line")


def _anthropic_conv(results: list[str], text: str | None = NOTE) -> list[dict]:
    """Claude-style: tool_use blocks, then one user message of tool_result blocks (and a text block),
    then the agent's next step (another tool call answered), as a harness stubbing older outputs sends."""
    uses = [{"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": f"src/m{i}.py"}}
            for i in range(len(results))]
    blocks = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": r} for i, r in enumerate(results)]
    return [{"role": "user", "content": TASK["content"]},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading them."}, *uses]},
            {"role": "user", "content": blocks + ([{"type": "text", "text": text}] if text else [])},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "run",
                                               "input": {"cmd": "pytest tests/parser -x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": _lines(9, 5)}]}]


@pytest.mark.parametrize("n", [1, 3])
def test_anthropic_tool_result_blocks(servers, n):
    """tool_result blocks in one user message (with a text block): the first result stubbed."""
    rest = [KEPT, _lines(8, 6)][:n - 1]
    _splices(messages, servers["chatml"], _anthropic_conv([LONG, *rest]), _anthropic_conv([STUB, *rest]),
             f"anthropic-{n}")


def _response_items(outputs: list[str]) -> list[dict]:
    items = [{"type": "message", "role": "user", "content": TASK["content"]}]
    for i, _ in enumerate(outputs):
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "read_file",
                      "arguments": json.dumps({"path": f"src/m{i}.py"})})
    items += [{"type": "function_call_output", "call_id": f"call_{i}", "output": o} for i, o in enumerate(outputs)]
    return items + [{"type": "message", "role": "user", "content": NOTE}]


def test_responses_input_items(servers):
    _splices(responses, servers["chatml"], _response_items([LONG, KEPT]), _response_items([STUB, KEPT]), "responses")


def test_an_edit_that_cannot_splice_says_why(servers):
    """Nothing after the edit reappears (the rest was rewritten too): exact, with a reason to act on."""
    srv = servers["chatml"]
    conv = lambda out, note: [TASK, {"role": "user", "content": out}, {"role": "user", "content": note}]  # noqa: E731
    chat(srv, conv(LONG, NOTE), "rewritten")
    got = chat(srv, conv(STUB, _words(9, 40)), "rewritten", "amortize")
    report = got["kv_edit"]
    assert report["applied"] is False and report["fallback"] == "no_realignment", report
    assert "min_run_tokens" in report["detail"] and "send the text after the edit unchanged" in report["detail"]
    assert got["cached"] == report["exact_prefix_tokens"]


# ---- Qwen 2.5's template, native tool format -----------------------------------------------------


def test_qwen_tool_responses_in_one_user_turn(servers):
    calls = [_call(i, "read_file", {"path": f"src/m{i}.py"}) for i in (1, 2, 3)]
    conv = lambda out: [TASK, {"role": "assistant", "content": "", "tool_calls": calls},  # noqa: E731
                        {"role": "tool", "tool_call_id": "call_1", "content": out},
                        {"role": "tool", "tool_call_id": "call_2", "content": KEPT},
                        {"role": "tool", "tool_call_id": "call_3", "content": _lines(7, 6)},
                        {"role": "user", "content": NOTE}]
    _splices(chat, servers["qwen"], conv(LONG), conv(STUB), "q-tools", boundary="line")


def test_qwen_anthropic_tool_results(servers):
    _splices(messages, servers["qwen"], _anthropic_conv([LONG, KEPT, _lines(8, 6)], None),
             _anthropic_conv([STUB, KEPT, _lines(8, 6)], None), "q-anthropic", boundary="line")


def test_qwen_responses_function_call_outputs(servers):
    _splices(responses, servers["qwen"], _response_items([LONG, KEPT]), _response_items([STUB, KEPT]), "q-responses",
             boundary="line")


def test_qwen_tool_call_argument(servers):
    _splices(chat, servers["qwen"], _write_then_run(LONG, ""), _write_then_run(STUB, ""), "q-arg", boundary="line")
