"""`vllm-mlx-persist patch --upstream-tests`: vllm-mlx's own test suite, from the sdist of the pinned
version, run on a pristine copy of the installed vllm_mlx and on a copy carrying the seam. Every
test that passes pristine must pass patched; the report lists each one that does not, with counts,
and the exit status is 1 if there is any.

Each test file runs in its own pytest process (vllm-mlx's tests replace modules in sys.modules and
patch module globals), with the copy under test first on PYTHONPATH and a HOME of its own. The
pristine and the patched run of a file are started side by side, so both see the same load; a file
where a test regressed is run again on both, and a test that passes patched on that second run is
reported as flaky rather than as a regression. `--each` also checks each patch as its pull request
stands (0001 and 0002 alone, 0003-0005 on 0001) against the same pristine runs.

About 175 tests fail on pristine vllm-mlx on a text-serving install (mlx-vlm, torch and audio
packages missing), and those marked for Apple Silicon skip elsewhere: they count in neither column.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ... import patcher
from . import copies as upstream

PRISTINE, PATCHED = "pristine", "patched"
# A test's outcomes from worst to best; a test id reported more than once keeps its worst.
OUTCOMES = ("error", "failed", "skipped", "passed")
_RUNNING: set[subprocess.Popen] = set()  # pytest processes, killed if the check is interrupted


@dataclass
class Run:
    """Test files run in one pytest process on one tree: each test id's outcome, or a note saying
    why there are none."""

    files: list[str]  # relative to tests/
    tree: str
    outcomes: dict[str, str]
    returncode: int
    seconds: float
    note: str = ""


@dataclass
class Comparison:
    """The suite's results on pristine and on one configuration of the series; `regressions` pass
    pristine and fail patched, twice."""

    files: int
    tests: int
    passed: dict[str, int]
    skipped: dict[str, int]
    regressions: list[str] = field(default_factory=list)
    flaky: list[str] = field(default_factory=list)  # failed patched once, passed on the rerun
    only_patched: list[str] = field(default_factory=list)  # pass patched, not pristine
    without_results: list[str] = field(default_factory=list)  # "files (tree): why"
    seconds: float = 0.0


def parse_junit(path: Path, files: Sequence[str]) -> dict[str, str]:
    """`{test id: outcome}` from pytest's JUnit XML; ids read `file::Class::name[param]`, and a file
    that failed to import has the one test `file::<collection>`."""
    stems = {Path(f).stem: f for f in files}
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname") or "", case.get("name") or "?"
        if not classname:  # a collection error names the module
            classname, name = name, "<collection>"
        parts = classname.split(".")
        at = next((i for i, part in enumerate(parts) if part in stems), None)
        where = [stems[parts[at]], *parts[at + 1:]] if at is not None else [classname]
        tags = {child.tag for child in case}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")
        test_id = "::".join([*where, name])
        out[test_id] = min(outcome, out.get(test_id, "passed"), key=OUTCOMES.index)
    return out


def run_pytest(src: Path, files: Sequence[str], tree: str, path: Path, work: Path, timeout: float,
               env_extra: Optional[dict[str, str]] = None) -> Run:
    """Run `src/tests/<files>` with pytest in one process, `path` first on PYTHONPATH."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{Path(files[0]).stem}-{tree}-", dir=work))
    xml = run_dir / "junit.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))  # models stay where they are
    env["HOME"] = str(run_dir / "home")  # what a test writes under ~ stays out of the other trees' way
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           "--rootdir", str(src), "-c", str(src / "pyproject.toml"), f"--junitxml={xml}",
           *(str(src / "tests" / f) for f in files)]
    t0 = time.monotonic()
    with open(run_dir / "output.txt", "wb") as log:
        # cwd: a folder without vllm_mlx, since `python -m` puts the working directory first on sys.path
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _RUNNING.add(proc)
        try:
            rc, note = proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, note = proc.wait(), f"timed out after {timeout:.0f} s"
        finally:
            _RUNNING.discard(proc)
    seconds = time.monotonic() - t0
    outcomes: dict[str, str] = {}
    if xml.exists():
        try:
            outcomes = parse_junit(xml, files)
        except ET.ParseError as e:
            note = note or f"unreadable JUnit XML ({e})"
    elif not note:
        note = f"pytest exited with status {rc} and no results: {_last_words(run_dir / 'output.txt')}"
    return Run(list(files), tree, outcomes, rc, seconds, note)


def _last_words(output: Path) -> str:
    """What a pytest process that left no results said last (a fatal error, else its last line)."""
    lines = [line.strip() for line in output.read_text(errors="replace").splitlines() if line.strip()]
    fatal = [line[line.index("Fatal Python error"):] for line in lines if "Fatal Python error" in line]
    return (fatal or lines or ["no output"])[-1][:200]


def _kill(proc: subprocess.Popen) -> None:
    """Kill a pytest process and whatever it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_groups(src: Path, groups: Sequence[Sequence[str]], trees: dict[str, Path], work: Path, *, jobs: int,
               timeout: float, on_group: Callable[[dict[str, Run]], None] = lambda runs: None,
               env: Optional[dict[str, str]] = None) -> dict[str, list[Run]]:
    """`{tree: [Run per group]}`: each group of test files in one process on every tree, `jobs`
    processes at a time, a group's trees one after the other in the queue (side by side with 2
    jobs). `on_group` gets a group's runs once all its trees are done."""
    results: dict[str, list[Run]] = {tree: [] for tree in trees}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        queued = [{tree: pool.submit(run_pytest, src, group, tree, path, work, timeout, env)
                   for tree, path in trees.items()} for group in groups]
        try:
            for futures in queued:
                runs = {tree: future.result() for tree, future in futures.items()}
                for tree, run in runs.items():
                    results[tree].append(run)
                on_group(runs)
        except BaseException:  # interrupted: start nothing more and leave no pytest behind
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in list(_RUNNING):
                _kill(proc)
            raise
    return results


def compare(pristine: Sequence[Run], patched: Sequence[Run]) -> Comparison:
    """Counts and the tests that pass in one tree and not in the other (no rerun)."""
    base = {k: v for run in pristine for k, v in run.outcomes.items()}
    new = {k: v for run in patched for k, v in run.outcomes.items()}
    ok_base = {k for k, v in base.items() if v == "passed"}
    ok_new = {k for k, v in new.items() if v == "passed"}
    without = [f"{', '.join(r.files)} ({r.tree}): {r.note}" for r in (*pristine, *patched) if r.note]
    files = {f for r in (*pristine, *patched) for f in r.files}
    return Comparison(files=len(files), tests=len(set(base) | set(new)),
                      passed={PRISTINE: len(ok_base), PATCHED: len(ok_new)},
                      skipped={PRISTINE: sum(v == "skipped" for v in base.values()),
                               PATCHED: sum(v == "skipped" for v in new.values())},
                      regressions=sorted(ok_base - ok_new), only_patched=sorted(ok_new - ok_base),
                      without_results=sorted(without))


def select_files(src: Path, patterns: Sequence[str] = ()) -> list[str]:
    """The suite's test files (`tests/test_*.py`), those matching one of `patterns` if any are given."""
    files = sorted(p.name for p in (src / "tests").glob("test_*.py"))
    if not patterns:
        return files
    chosen = [f for f in files if any(fnmatch.fnmatch(f, p) or fnmatch.fnmatch(f, p + ".py") for p in patterns)]
    if not chosen:
        raise ValueError(f"no test file of {src / 'tests'} matches {', '.join(patterns)}")
    return chosen


def _without(run: Run, files: Sequence[str]) -> Run:
    """`run` less the results of `files`."""
    keep = [f for f in run.files if f not in files]
    outcomes = {k: v for k, v in run.outcomes.items() if k.split("::", 1)[0] in keep}
    return Run(keep, run.tree, outcomes, run.returncode, run.seconds, run.note)


def label(numbers: Optional[Sequence[str]]) -> str:
    """A configuration's name: "series" (every patch, as `vllm-mlx-persist patch` applies them) or
    its patches' numbers joined by "+" ("0001+0003")."""
    return "series" if numbers is None else "+".join(numbers)


def check(files: Sequence[str] = (), configs: Sequence[Optional[Sequence[str]]] = (None,), *,
          jobs: Optional[int] = None, timeout: float = 600.0, cache_dir: Optional[Path] = None,
          group_size: int = 1, offline: bool = False,
          log: Callable[[str], None] = print, verbose: bool = True) -> dict[str, Comparison]:
    """Fetch the suite, build a pristine tree and one per configuration (patch numbers; None: the
    whole series), run `files` (patterns; empty: all) on each, `group_size` files per process (0:
    all in one), and compare each configuration with pristine. The files a group's process left
    without results and every file with a regression run again, each in its own process.
    `offline`: HF_HUB_OFFLINE=1 for the tests. Raises upstream.MissingTestDeps without the packages
    the tests import (the `dev` extra), upstream.Unavailable without the sdist."""
    t0 = time.monotonic()
    upstream.require_test_deps()
    src = upstream.fetch_tests(cache_dir or upstream.default_cache_dir())
    chosen = select_files(src, files)
    jobs = jobs or min(2, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="vllm-mlx-upstream-tests-") as tmp:
        work = Path(tmp)
        trees = {PRISTINE: upstream.make_tree(work / PRISTINE, ())}
        for numbers in configs:
            trees[label(numbers)] = upstream.make_tree(work / label(numbers), numbers)

        def on_group(runs: dict[str, Run]) -> None:
            if verbose:
                counts = " ".join(f"{sum(v == 'passed' for v in r.outcomes.values()):>{max(4, len(t))}}"
                                  for t, r in runs.items())
                notes = "; ".join(f"{t}: {r.note[:60]}" for t, r in runs.items() if r.note)
                files = runs[PRISTINE].files
                name = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more"
                slowest = max(r.seconds for r in runs.values())
                log(f"  {name:<56} {counts}  {slowest:5.1f} s{'  ' + notes if notes else ''}")

        if verbose:
            log(f"  {'tests passed':<56} {' '.join(f'{t:>{max(4, len(t))}}' for t in trees)}  slowest run")
        size = group_size if group_size > 0 else len(chosen)
        groups = [chosen[i:i + size] for i in range(0, len(chosen), size)]
        env = {"HF_HUB_OFFLINE": "1"} if offline else None
        runs = run_groups(src, groups, trees, work, jobs=jobs, timeout=timeout, on_group=on_group, env=env)
        # Files a group's process left without results (it died, or a file ended the session: some
        # call sys.exit() as they are imported off Apple Silicon) run again, each in its own process.
        redo = sorted({f for t in trees for r in runs[t] if len(r.files) > 1 for f in r.files
                       if r.note or not any(k.startswith(f + "::") for k in r.outcomes)})
        if redo:
            log(f"running again, each in its own process: {', '.join(redo)}")
            again = run_groups(src, [[f] for f in redo], trees, work, jobs=jobs, timeout=timeout,
                               on_group=on_group, env=env)
            runs = {t: [_without(r, redo) for r in runs[t] if set(r.files) - set(redo)] + again[t]
                    for t in trees}
        results = {t: compare(runs[PRISTINE], runs[t]) for t in trees if t != PRISTINE}
        suspects = sorted({t.split("::", 1)[0] for r in results.values() for t in r.regressions})
        if suspects:
            log(f"running again, each in its own process: {', '.join(suspects)}")
            again = run_groups(src, [[f] for f in suspects], trees, work, jobs=jobs, timeout=timeout,
                               on_group=on_group, env=env)
            for t, result in results.items():
                second = set(compare(again[PRISTINE], again[t]).regressions)
                result.flaky = sorted(set(result.regressions) - second)
                result.regressions = sorted(set(result.regressions) & second)
    for result in results.values():
        result.seconds = time.monotonic() - t0
    return results


def report(results: dict[str, Comparison]) -> str:
    """Per configuration: the counts and every test that passes pristine and fails with it."""
    first = next(iter(results.values()))
    lines = [f"vllm-mlx {upstream.SPEC.version}'s own tests: {first.files} files, {first.tests} tests, "
             f"{first.seconds:.0f} s; on pristine vllm-mlx {first.passed[PRISTINE]} passed, "
             f"{first.skipped[PRISTINE]} skipped"]
    for name, result in results.items():
        lines.append(f"with {'the whole series' if name == 'series' else 'patches ' + name}: "
                     f"{result.passed[PATCHED]} passed, {result.skipped[PATCHED]} skipped; "
                     f"passing pristine and failing: {len(result.regressions)}")
        lines += [f"    {t}" for t in result.regressions]
        for title, items in (("flaky (failed once, passed when run again)", result.flaky),
                             ("passing only with the patches", result.only_patched),
                             ("files without results", result.without_results)):
            if items:
                lines.append(f"  {title}: {len(items)}")
                lines += [f"    {t}" for t in items]
    return "\n".join(lines)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist patch --upstream-tests", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="test files of vllm-mlx's tests/ to run (globs; default: all)")
    p.add_argument("--patches", action="append", metavar="NUMBERS",
                   help="compare pristine with these patches applied, comma-separated (e.g. 0001,0003); "
                        "may be given more than once (default: the whole series)")
    p.add_argument("--each", action="store_true",
                   help="also each patch as its pull request stands: 0001 and 0002 alone, 0003-0005 on 0001")
    p.add_argument("--group-size", type=int, default=1, metavar="N",
                   help="test files per pytest process (default: 1; 0: all in one). Faster, but the files "
                        "of a process may affect each other, alike on every tree")
    p.add_argument("--offline", action="store_true",
                   help="HF_HUB_OFFLINE=1 for the tests: where the model hub cannot be reached, the tests that "
                        "download a model fail at once instead of after retries (test_streaming_detokenizer.py "
                        "takes 8 minutes otherwise)")
    p.add_argument("--jobs", type=int, help="pytest processes at a time (default: 2, or 1 on one core)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a test file may run (default: 600)")
    p.add_argument("--cache-dir", type=Path, help="where the sdist is kept (default: inside the virtual "
                                                  "environment, else ~/.cache/vllm-mlx-persist)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--quiet", action="store_true", help="no line per test file")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """Run the check; exit status 0 (no regression), 1 (regressions) or 2 (could not run)."""
    args = _parse(argv)
    if threading.current_thread() is threading.main_thread():  # stop the pytest processes, as Ctrl-C does
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    configs: list[Optional[tuple[str, ...]]] = [
        tuple(n.strip() for n in given.split(",") if n.strip()) for given in args.patches or ()]
    if not configs or args.each:
        configs.insert(0, None)
    if args.each:
        configs += [c for c in upstream.each_patch() if c not in configs]
    try:
        results = check(args.files, configs, jobs=args.jobs, timeout=args.timeout, cache_dir=args.cache_dir,
                        group_size=args.group_size, offline=args.offline, verbose=not args.quiet,
                        log=lambda s: print(s, flush=True))
    except (upstream.Unavailable, upstream.MissingTestDeps, patcher.PatchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({t: asdict(r) for t, r in results.items()}, indent=1) + "\n")
    return 1 if any(r.regressions for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
