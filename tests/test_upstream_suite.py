"""vllm-mlx's own tests of the modules the seam patches (scheduler, engine core, the serve command, the
server's handlers and usage), from the sdist of the pinned vllm-mlx, on a pristine copy of the
installed vllm_mlx and on one carrying the series: what passes pristine passes patched. The files run
together, one pytest process per copy, next to a third copy broken on purpose (the seam without the
scheduler's `cache_backend` default, the bug vllm-mlx's tests first caught) to show the check sees a
regression. The whole suite, each file in its own process: `vllm-mlx-persist patch --upstream-tests`."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_mlx_persist.tools.upstream import copies as upstream

from vllm_mlx_persist.tools.upstream import suite as upstream_tests
from vllm_mlx_persist.tools.upstream.suite import PRISTINE, Comparison

# Each exercises code the series changes. The three copies took 53-58 s here under a load average
# of 8-9 on 2 cores (the whole suite, file by file: `vllm-mlx-persist patch --upstream-tests`).
FILES = (
    "test_scheduler_max_kv_size.py",  # Scheduler built without __init__ (0001)
    "test_ssd_shutdown_wiring.py",  # engine teardown with stand-in schedulers (0001)
    "test_engine_core_idle_polling.py",  # the engine loop and its teardown (0001)
    "test_engine_core_thread_streams.py",
    "test_batched_engine_owner_thread.py",  # BatchedEngine -> EngineCore (0001, 0003)
    "test_llm_mtp_per_request_counters.py",  # generate() into API metadata (0002, 0003)
    "test_request.py",  # Request / RequestOutput fields (0001-0003)
    "test_cli.py",  # the serve command's wiring into SchedulerConfig (0001, 0005)
    "test_server_cache_controls.py",  # cache clear/stats endpoints (0001)
    "test_lifecycle_server.py",  # chat, completion and Anthropic handlers (0002, 0003)
    "test_chat_template_kwargs.py",  # streamed chat and Anthropic paths (0002, 0003)
)
BROKEN = "broken"
DEFAULT = "    cache_backend: Optional[Any] = None\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Comparison]:
    try:
        src = upstream.fetch_tests(upstream.default_cache_dir())
    except upstream.Unavailable as e:
        pytest.skip(f"vllm-mlx's own tests are not available here: {e}")
    upstream.require_test_deps()  # the `dev` extra: a clear error, not a run-time install, without it
    work = tmp_path_factory.mktemp("upstream")
    trees = {PRISTINE: upstream.make_tree(work / PRISTINE, ()),
             "series": upstream.make_tree(work / "series", None),
             BROKEN: upstream.make_tree(work / BROKEN, None)}
    scheduler = trees[BROKEN] / "vllm_mlx" / "scheduler.py"
    text = scheduler.read_text()
    assert text.count(DEFAULT) == 1, "the seam's Scheduler.cache_backend default moved: update DEFAULT"
    scheduler.write_text(text.replace(DEFAULT, ""))
    runs = upstream_tests.run_groups(src, [FILES], trees, work, jobs=2, timeout=600)
    return {t: upstream_tests.compare(runs[PRISTINE], runs[t]) for t in trees if t != PRISTINE}


def test_the_series_passes_what_pristine_vllm_mlx_passes(results):
    result = results["series"]
    assert not result.without_results, result.without_results
    assert result.files == len(FILES) and result.passed[PRISTINE] >= 250, upstream_tests.report(results)  # 261 here
    assert result.regressions == [], upstream_tests.report(results)


def test_the_check_sees_a_regression(results):
    """The copy without the class default fails vllm-mlx's tests that build a Scheduler without
    __init__, and only those."""
    regressions = results[BROKEN].regressions
    assert len(regressions) >= 10, upstream_tests.report(results)
    assert {t.split("::")[0] for t in regressions} == {"test_scheduler_max_kv_size.py"}, regressions


def test_an_unreachable_index_is_a_reason_to_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as pip behaves offline: nothing can be found
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(upstream.Unavailable, match="could not download the vllm-mlx 0.6.0 sdist"):
        upstream.fetch_tests(tmp_path)
    assert not (tmp_path / "vllm-mlx-0.6.0-tests").exists()


def test_missing_test_deps_are_named_not_installed(tmp_path, monkeypatch):
    """Without a package vllm-mlx's tests import, the check stops before downloading anything and
    says what to install (the `dev` extra, or the package by name)."""
    monkeypatch.setitem(upstream.TEST_DEPS, "no_such_module_for_vllm_mlx_tests", "no-such-dist")
    assert "no-such-dist" in upstream.missing_test_deps()
    with pytest.raises(upstream.MissingTestDeps, match=r'pip install -e "\.\[dev\]".*pip install .*no-such-dist'):
        upstream.require_test_deps()
    with pytest.raises(upstream.MissingTestDeps, match="no-such-dist"):
        upstream_tests.check(cache_dir=tmp_path, verbose=False)
    assert list(tmp_path.iterdir()) == [], "nothing is downloaded before the packages are there"


def test_make_tree_carries_exactly_the_patches_asked_for(tmp_path):
    pristine = upstream.make_tree(tmp_path / "pristine", ())
    alone = upstream.make_tree(tmp_path / "0002", ("0002",))
    stacked = upstream.make_tree(tmp_path / "0003", ("0001", "0003"))
    assert not (pristine / "vllm_mlx" / "plugins.py").exists()
    assert not (alone / "vllm_mlx" / "plugins.py").exists()
    assert "cached_tokens=output.cached_tokens" in (alone / "vllm_mlx/engine/batched.py").read_text()
    plugins = (stacked / "vllm_mlx" / "plugins.py").read_text()
    assert "vllm_mlx_cache_namespace" in plugins and "vllm_mlx_api_routers" not in plugins
    with pytest.raises(ValueError, match="no patch 0009"):
        upstream.make_tree(tmp_path / "bad", ("0009",))


def test_each_patch_stands_as_docs_upstream_md_says():
    """--each checks 0001 and 0002 alone and 0003-0005 on 0001, the "Needs" column of the doc's table."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "upstream.md").read_text()
    for config in upstream.each_patch():
        row = next(line for line in doc.splitlines() if line.startswith(f"| [{config[-1]}-"))
        needs = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert needs == (", ".join(config[:-1]) or "–"), (config, row)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="tests.test_bad"><error message="collection failure"/></testcase>
<testcase classname="tests.test_ok.TestA" name="test_p[1]"/>
<testcase classname="tests.test_ok.TestA" name="test_p[2]"><failure message="assert"/></testcase>
<testcase classname="tests.test_ok" name="test_skip"><skipped message="no"/></testcase>
<testcase classname="tests.test_ok" name="test_teardown"><error message="teardown"/></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_and_the_comparison(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    outcomes = upstream_tests.parse_junit(xml, ["test_bad.py", "test_ok.py"])
    assert outcomes == {"test_bad.py::<collection>": "error", "test_ok.py::TestA::test_p[1]": "passed",
                        "test_ok.py::TestA::test_p[2]": "failed", "test_ok.py::test_skip": "skipped",
                        "test_ok.py::test_teardown": "error"}
    patched = dict(outcomes, **{"test_ok.py::TestA::test_p[1]": "failed", "test_ok.py::TestA::test_p[2]": "passed"})
    run = lambda tree, o: upstream_tests.Run(["test_bad.py", "test_ok.py"], tree, o, 1, 1.0)  # noqa: E731
    gone = upstream_tests.Run(["test_gone.py"], "x", {}, -6, 1.0, "Fatal Python error: Aborted")
    result = upstream_tests.compare([run(PRISTINE, outcomes)], [run("x", patched), gone])
    assert result.regressions == ["test_ok.py::TestA::test_p[1]"]
    assert result.only_patched == ["test_ok.py::TestA::test_p[2]"]
    assert result.passed == {PRISTINE: 1, "patched": 1} and result.skipped == {PRISTINE: 1, "patched": 1}
    assert result.files == 3 and result.without_results == ["test_gone.py (x): Fatal Python error: Aborted"]
