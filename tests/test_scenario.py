"""The scenario runner (`vllm-mlx-persist scenario`) against one real `vllm-mlx serve
--continuous-batching --cache-backend persist_q4` on a tiny model, and its file validation.

Every shipped scenario runs with small params (short texts, 6-token replies). The comparison run
replays the same requests, so at temperature 0 its outputs must equal the first run's (4-bit
reuse and cold prefill give the same greedy tokens on these models, as in test_e2e_server.py).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from vllm_mlx_persist.tools.serving import Server
from vllm_mlx_persist.tools.scenarios import retokenize
from vllm_mlx_persist.tools.scenarios import main as runner
from vllm_mlx_persist.tools.scenarios.spec import ScenarioError, load_scenario, shipped_scenarios

# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": 32, "hot_mb": 64, "key_format": "q4"}
SMALL = {  # params that keep each shipped scenario to a few seconds on 2 cores
    "negotiation": {"terms_words": 30, "reply_tokens": 6},
    "gossip": {"story_words": 30, "reply_tokens": 6},
    "routing": {"article_words": 30, "reply_tokens": 6},
    "fanout": {"doc_words": 120, "reply_tokens": 6},
}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with Server(model_dir("llama", "micro"), tmp_path_factory.mktemp("home"), options=OPTIONS) as s:
        yield s


def _by_agent(requests: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in requests:
        out.setdefault(r["agent_id"], []).append(r)
    return out


def test_every_shipped_scenario_is_tested():
    assert set(shipped_scenarios()) == set(SMALL)


@pytest.fixture(scope="module")
def shipped(server, tmp_path_factory) -> dict[str, tuple[dict, str, int]]:
    """Each shipped scenario run once through the CLI, with its no-cache comparison:
    name -> (the --json report, the printed table, text matches the server made during the run)."""
    runs = {}
    for name in sorted(SMALL):
        out = tmp_path_factory.mktemp(name) / "report.json"
        args = [name, "--url", server.url, "--json", str(out)]
        for k, v in SMALL[name].items():
            args += ["--param", f"{k}={v}"]
        before = retokenize.text_match_stats(server.url)
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            assert runner.main(args) == 0, server.log_tail()
        matched = retokenize.text_match_stats(server.url)["text_matches"] - before["text_matches"]
        runs[name] = (json.loads(out.read_text()), table.getvalue(), matched)
    return runs


@pytest.mark.parametrize("name", sorted(SMALL))
def test_shipped_scenario_runs_and_reuses_only_what_it_may(shipped, name):
    report, table, matched = shipped[name]
    sc = load_scenario(name, SMALL[name])
    reqs, cmp = report["requests"], report["compare_requests"]

    assert len(reqs) == sum(len(s.agents) for ph in sc.phases for s in ph.steps) == len(cmp)
    assert [r["phase"] for r in reqs] == [r["phase"] for r in cmp]
    for ph in sc.phases:
        assert f"\n{ph.name} " in table
    assert report["compare"]["mode"] == "no-cache"
    # Replayed under throwaway ids: nothing reused, same prompts, same greedy outputs. Where the
    # server matched a re-tokenized reply by text, it served the stored tokens instead (same text,
    # other token ids: usage counts those), and the output is that of those tokens.
    assert all(c["cached_tokens"] == 0 for c in cmp)
    assert [c["messages"] for c in cmp] == [r["messages"] for r in reqs]
    same = [c["prompt_tokens"] == r["prompt_tokens"] for r, c in zip(reqs, cmp)]
    assert all(ok or r["cached_tokens"] > 0 for ok, r in zip(same, reqs)) and (all(same) or matched > 0)
    assert all(r["output"] == c["output"] for ok, r, c in zip(same, reqs, cmp) if ok)

    for agent_id, turns in _by_agent(reqs).items():
        name_ = turns[0]["agent"]
        agent = sc.agents[name_]
        if agent.fork_from is None:
            assert turns[0]["cached_tokens"] == 0, agent_id  # a fresh id starts cold
        # Later turns of one id reuse at least the whole previous prompt, never the newest token.
        for prev, cur in zip(turns, turns[1:]):
            assert prev["prompt_tokens"] <= cur["cached_tokens"] < cur["prompt_tokens"], (agent_id, turns)
        if agent.ephemeral:
            assert agent_id.endswith("-" + turns[0]["phase"]) and {t["phase"] for t in turns} == {turns[0]["phase"]}

    total = report["summary"][-1]
    assert total["phase"] == "*" and total["cached_tokens"] > 0 and total["compare"]["cached_tokens"] == 0
    assert total["prefill_tokens"] < total["compare"]["prefill_tokens"]


def test_permanent_agents_carry_across_phases_and_ephemeral_agents_do_not(shipped):
    sc = load_scenario("negotiation", SMALL["negotiation"])
    reqs = shipped["negotiation"][0]["requests"]
    mediator = [r for r in reqs if r["agent"] == "mediator"]
    later = [r for r in mediator if r["phase"] != "buyer_room"]
    # The first request of a permanent agent in a later phase extends its earlier phases' cache.
    assert later[0]["phase"] == "seller_room" and later[0]["cached_tokens"] >= mediator[2]["prompt_tokens"]
    arbiter = [r for r in reqs if r["agent"] == "arbiter"]
    assert [r["phase"] for r in arbiter] == ["final_table", "verdict"]
    assert arbiter[0]["agent_id"] != arbiter[1]["agent_id"]
    assert [r["cached_tokens"] for r in arbiter] == [0, 0]
    # The verdict arbiter sees every phase's transcript; the final-table one only its own phase.
    verdict_prompt = arbiter[1]["messages"][-1]["content"]
    assert all(f", {ph.name}]" in verdict_prompt for ph in sc.phases[:4])
    assert "buyer_room]" not in arbiter[0]["messages"][-1]["content"]


def test_private_memories_stay_private(server):
    """Gossip: in the reunion, Bob's prompt holds nothing of Alice and Eve's private talk; Alice's does."""
    report = runner.run_scenario(load_scenario("gossip", SMALL["gossip"]), server.url, compare=False)
    assert report["compare_requests"] is None
    last = {r["agent"]: r for r in report["requests"]}
    text = lambda r: "\n".join(m["content"] for m in r["messages"])
    assert "[eve, alice_eve]" not in text(last["bob"]) and "alice_eve" not in text(last["bob"])
    assert "[eve, alice_eve]" in text(last["alice"]) and "[bob, alice_bob]" in text(last["alice"])
    assert "[alice, alice_bob]" not in text(last["eve"]) and "[bob, alice_bob]" not in text(last["eve"])


def test_fork_from_is_sent_and_workers_reuse_the_coordinators_document(shipped):
    """Each worker names the coordinator as its parent and its first turn starts from the coordinator's
    blocks: at least every whole block of the coordinator's prompt (system prompt + document; forks
    share whole blocks only, the parent's partial tail is prefilled by the child)."""
    reqs = shipped["fanout"][0]["requests"]
    coord = reqs[0]
    workers = [r for r in reqs if r["phase"] == "fanout"]
    assert len(workers) == 8 and all(w["fork_from"] == coord["agent_id"] for w in workers)
    parent_history = coord["messages"] + [{"role": "assistant", "content": coord["output"]}]
    assert all(w["messages"][: len(parent_history)] == parent_history for w in workers)
    assert all(w["prompt_tokens"] > coord["prompt_tokens"] for w in workers)
    assert coord["cached_tokens"] == 0 and coord["prompt_tokens"] >= 2 * OPTIONS["block_size"]
    whole = coord["prompt_tokens"] // OPTIONS["block_size"] * OPTIONS["block_size"]
    for w in workers:
        assert whole <= w["cached_tokens"] < w["prompt_tokens"], (coord["prompt_tokens"], w)
    gather = reqs[-1]
    assert gather["agent"] == "coordinator" and all(f"[w{i}, " in gather["messages"][-1]["content"]
                                                    for i in range(1, 9))


def test_compare_url_replays_the_same_ids(server):
    """--compare-url sends the same agent ids: against the same server, everything is already cached."""
    sc = load_scenario("gossip", SMALL["gossip"])
    report = runner.run_scenario(sc, server.url, compare_url=server.url + "/v1")
    assert report["compare"]["mode"] == "url"
    seen = set()
    for r, c in zip(report["requests"], report["compare_requests"]):
        assert c["agent_id"] == r["agent_id"] and c["output"] == r["output"]
        if r["agent_id"] not in seen:  # the agent's whole conversation is stored: all but one token reused
            assert c["cached_tokens"] == c["prompt_tokens"] - 1 > r["cached_tokens"] == 0
        else:  # then each replayed turn finds at least what the first run found (the agent keeps
            # branches, so the first run's longer history still covers the replayed prompt)
            assert c["cached_tokens"] >= r["cached_tokens"]
        seen.add(r["agent_id"])


BASE = {
    "name": "t",
    "agents": {"a": {}, "b": {"lifecycle": "ephemeral"}},
    "phases": [{"name": "p1", "agents": ["a", "b"], "prompt": "hi {agent}"}],
}


def _with(**changes) -> dict:
    d = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        obj, keys = d, path.split("__")
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        if value is _DEL:
            del obj[keys[-1]]
        else:
            obj[keys[-1]] = value
    return d


_DEL = object()


@pytest.mark.parametrize("changes, message", [
    ({"colour": "red"}, "unknown key(s) colour"),
    ({"phases": _DEL}, "missing key: phases"),
    ({"phases": []}, "phases must be a non-empty list"),
    ({"agents": _DEL}, "missing key: agents"),
    ({"agents": {"a b": {}}}, "may only contain letters"),
    ({"agents": {"../x": {}}}, "may only contain letters"),
    ({"agents__a": {"lifecycle": "forever"}}, "lifecycle must be one of permanent, ephemeral"),
    ({"agents__a": {"sytem": "typo"}}, "agents.a: unknown key(s) sytem"),
    ({"phases__0__agents": ["a", "carol"]}, "unknown agent 'carol'"),
    ({"phases__0__agents": []}, "non-empty list of agent names"),
    ({"phases__0__name": "p 1"}, "may only contain letters"),
    ({"phases__0__rounds": 0}, "rounds must be >= 1"),
    ({"phases__0__rounds": "many"}, "rounds must be an integer or the name of a param"),
    ({"phases__0__sees": "everything"}, "sees must be one of phase, all, own"),
    ({"phases__0__sees": {"agents": ["zed"]}}, "unknown agent 'zed'"),
    ({"phases__0__prompt": "hi {who}"}, "unknown placeholder {who}"),
    ({"phases__0__prompt": "{text:missing}"}, "names no text"),
    ({"phases__0__turns": [{"agents": ["a"]}]}, "either turns, or agents"),
    ({"phases__0__prompts": {"b": "x", "z": "y"}}, "unknown key(s) z"),
    ({"agents__b": {"fork_from": "a"}, "phases__0__agents": ["b", "a"]}, "b forks from a, who has not spoken"),
    ({"agents__b": {"fork_from": "b"}}, "is not another agent"),
    ({"agents__c": {}}, "never speak"),
    ({"texts": {"doc": {"modules": ["no_such_module_xyz"], "words": 10}}}, "has no Python source"),
    ({"texts": {"doc": {"modules": ["statistics"], "words": "n"}}}, "words must be an integer or the name of a param"),
])
def test_validation_errors_name_the_problem(changes, message):
    with pytest.raises(ScenarioError) as e:
        load_scenario(_with(**changes))
    assert message in str(e.value)


def test_validation_of_files_and_params(tmp_path, capsys):
    assert load_scenario(_with()).phases[0].agents == ("a", "b")
    with pytest.raises(ScenarioError, match="unknown param 'nope'"):
        load_scenario("gossip", {"nope": 1})
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nagents: {a: {}}\nphases:\n  - name: p\n    agents: [a, bob]\n")
    assert runner.main([str(bad), "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "phases[0] (p).agents: unknown agent 'bob'" in err
    bad.write_text("name: [unclosed\n")
    assert runner.main([str(bad), "--check"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert runner.main(["no-such-scenario", "--check"]) == 2
    assert "shipped scenarios: fanout, gossip, negotiation, routing" in capsys.readouterr().err


def test_retokenize_stats_matches_the_server(server, tiny_llama_dir):
    """retokenize-stats: its local chat template gives the server's prompt lengths, and every figure
    is consistent with what the server reported."""
    r = retokenize.run(server.url, str(tiny_llama_dir), conversations=2, turns=3, max_tokens=12, words=20)
    st = r["server_text_matching"]
    # A turn served by text matching reports the stored tokens' count, which may differ from the
    # re-tokenized prompt's; every other prompt has the server's length.
    assert r["turns_measured"] == 4 and r["prompt_length_mismatches"] <= st["text_matches"]
    for t in r["measured"]:
        # Reuse reaches about the previous prompt's end (a reply starting with whitespace may merge with
        # the template's newline). The tool's `stored` (previous usage prompt + completion - 1) is not an
        # upper bound once text matching serves stored tokens: seen exceeded by 1 (not explained yet).
        assert t["previous_prompt"] - 2 <= t["cached_tokens"] < t["prompt_tokens"], t
        assert t["reusable"] < t["prompt_tokens"]
        assert t["stored"] <= t["previous_prompt"] + 12 - 1
        assert t["diverged"] == (t["lost"] > 0) and (t["kind"] == "none") == (not t["diverged"])
    assert r["tokens_lost"] == sum(k["tokens_lost"] for k in r["by_kind"].values())
    # The server's text-matching counters over the run are read and reported (match_text is on).
    assert set(st) == {"text_matches", "tokens_matched_by_text"} and min(st.values()) >= 0
    assert st["tokens_matched_by_text"] >= st["text_matches"]
    text = retokenize.format_report(r)
    assert "turns measured (all after the first of each chat): 4" in text
    assert f"server's text matching over this run: {st['text_matches']} realignments" in text
