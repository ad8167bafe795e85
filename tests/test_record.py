"""The agent as one record (issue #30), at pool level on real MLX and through the offline CLI: an agent's
spliced histories are branches of its record, so its pin, the disk budget, the TTL, erasure (API and
offline) and listing act on all of it; the layout before the record (spliced histories as agents of
their own, `agent\\0amortized:g`) is moved into the record at load, and the offline tools handle it
too; the fork policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_lifecycle import agent_bytes_on_disk, budget_pool, files_naming
from test_pool import make_pool, prefill, tokens
from vllm_mlx_persist.chain import Branch, manifest_of
from vllm_mlx_persist.namespace import spliced_seed

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model():
    from vllm_mlx_persist.tools.models.build import build_model

    m, _ = build_model("llama", "tiny", seed=0)
    return m


def _with_spliced(pool, model, agent: str, seed: int) -> tuple[list[int], list[int]]:
    """An honest turn of `agent` and a spliced turn (generation 1) after it: (honest, spliced) tokens."""
    honest, spliced = tokens(40, seed=seed), tokens(20, seed=seed)[:8] + tokens(30, seed=seed + 100)
    pool.commit(agent, honest, prefill(model, honest)[0])
    pool.commit(agent, spliced, prefill(model, spliced)[0], generation=1)
    return honest, spliced


def test_a_pin_covers_the_agents_spliced_turns_under_the_disk_budget(model, tmp_path):
    """Issue #30: the pin was written to the agent's own manifest only, and the disk budget erased a
    pinned agent's newest amortize turn. Now it is a branch of the pinned record."""
    one = agent_bytes_on_disk(model, tmp_path)
    pool = budget_pool(model, tmp_path / "root", disk_budget=one * 4, hot_bytes=one)
    _, spliced = _with_spliced(pool, model, "pinned", 1)
    assert pool.set_pinned("pinned", True)
    for i in range(8):  # budget pressure: everyone else goes
        seq = tokens(40, seed=50 + i)
        pool.commit(f"other-{i}", seq, prefill(model, seq)[0])
        pool.flush()
    assert pool.snapshot()["budget_erasures"] >= 4
    pool.close()
    again = budget_pool(model, tmp_path / "root", disk_budget=one * 4, hot_bytes=one)
    m = again.match("pinned", spliced + [1], "r", edit="amortize")
    assert m.num_tokens == len(spliced) and m.source[1].generation == 1
    again.finish("r")
    again.close()


def test_the_ttl_and_erasure_take_the_whole_record(model, tmp_path):
    """TTL and erasure treated an agent and its spliced namespaces as unrelated agents: now an agent
    unused for the TTL goes with its spliced branches, and no file names it afterwards."""
    pool = budget_pool(model, tmp_path, ttl_s=3600)
    _with_spliced(pool, model, "old", 2)
    _with_spliced(pool, model, "new", 3)
    pool.flush()
    with pool.persister._cv:  # as if "old" was last used two hours ago
        pool.persister.index.agents["old"].last_used -= 7200
    pool.persister.budget.sweep()
    assert pool.agent_info("old") is None and not files_naming(tmp_path, "old")
    assert [b["generation"] for b in pool.agent_info("new")["spliced_branches"]] == [1]
    assert pool.erase("new") and not files_naming(tmp_path, "new") and pool.agent_info("new") is None
    pool.close()


def _legacy_root(model, tmp_path) -> tuple[Path, list[int], list[int]]:
    """A cache root as the build before the record left it: agent a's honest manifest, and its spliced
    history under the manifest of `a\\0amortized:1` (same block ids: the same chain seeds)."""
    pool = make_pool(model, tmp_path / "root")
    honest, spliced = _with_spliced(pool, model, "a", 4)
    pool.flush()
    record = pool.agent("a")
    own = [br for br in record.branches if not br.spliced]
    old = [Branch(br.block_ids, br.n_tokens, br.links, br.last_used, br.rotations) for br in record.branches
           if br.spliced]
    pool.store.write_manifest(manifest_of("a", own, False, 1.0))
    pool.store.write_manifest(manifest_of(spliced_seed("a", 1), old, False, 2.0))
    pool.close()
    return tmp_path / "root", honest, spliced


def test_the_layout_before_the_record_is_moved_into_it_at_load(model, tmp_path):
    root, honest, spliced = _legacy_root(model, tmp_path)
    pool = make_pool(model, root)
    assert [i["id"] for i in pool.list_agents(10)[0]] == ["a"]  # never listed as agents of their own
    assert [br.generation for br in pool.agent("a").branches] == [0, 1]
    assert pool.match("a", spliced + [1]).num_tokens <= 8  # an exact request: the honest prefix only
    hit = pool.match("a", spliced + [1], "r", edit="amortize")
    assert hit.num_tokens == len(spliced)
    pool.finish("r")
    pool.flush()
    assert [m.namespace for m in pool.store.list_manifests()] == ["a"]  # one manifest: the record's
    pool.close()
    again = make_pool(model, root)
    assert again.match("a", spliced + [1], "r", edit="amortize").num_tokens == len(spliced)
    again.close()


def test_offline_rm_erases_the_whole_record_in_either_layout(model, tmp_path):
    """Issue #30: offline `agents rm ID` left the agent's spliced histories (a manifest under its spliced
    namespace kept naming its blocks, and a restart served them to the same id's amortize request)."""
    root, _, spliced = _legacy_root(model, tmp_path / "legacy")
    listed = subprocess.run([str(BIN / "vllm-mlx-persist"), "agents", "list", "--cache-dir", str(root)],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout.count("\na\t") == 1 and "amortized" not in listed.stdout
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "agents", "rm", "a", "--cache-dir", str(root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not list(root.rglob("agents/*.json")) and not list(root.rglob("*.safetensors"))
    pool = make_pool(model, root)
    assert pool.agent("a") is None and pool.match("a", spliced + [1], "r", edit="amortize").num_tokens == 0
    pool.close()

    pool = make_pool(model, tmp_path / "record")  # the record's own layout
    _with_spliced(pool, model, "b", 5)
    pool.close()
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "agents", "rm", "b", "--cache-dir", str(tmp_path / "record")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not list((tmp_path / "record").rglob("*.safetensors")), r.stderr


@pytest.mark.parametrize("policy, setting, allowed", [
    ("open", None, True), ("open", False, False), ("open", True, True),
    ("listed", None, False), ("listed", True, True), ("listed", False, False),
    ("none", True, False), ("none", None, False),
])
def test_the_fork_policy_and_the_agents_setting(model, tmp_path, policy, setting, allowed):
    pool = make_pool(model, tmp_path, fork_policy=policy)
    seq = tokens(40)
    pool.commit("parent", seq, prefill(model, seq)[0])
    if setting is not None:
        assert pool.set_forkable("parent", setting)
    assert pool.may_fork("parent") is allowed
    assert pool.may_fork("nobody") is (policy == "open")  # an unknown parent: as the policy says
    assert pool.agent_info("parent")["forkable"] is allowed
    pool.close()
    again = make_pool(model, tmp_path, fork_policy=policy)  # the setting is in the record's manifest
    assert again.may_fork("parent") is allowed and not again.set_forkable("nobody", True)
    again.close()
