"""The fork server the tests start their servers through (tools/serving/forkserver.py): a forked child is a
process of its own, with its own exit status, output and signals, as Popen's would be. (Its own
environment and working directory are what every end-to-end test's server relies on: its HOME, its
cache dir, its injected faults.)"""

from __future__ import annotations

import os
import platform
import signal
import subprocess

import pytest

from vllm_mlx_persist.tools.serving import forkserver
from vllm_mlx_persist.tools.serving import VLLM_MLX

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="the fork server is Linux only")


@pytest.fixture(scope="module")
def server():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    srv = forkserver.ForkServer(env)
    yield srv, env
    srv.close()


def test_a_child_exits_and_writes_as_vllm_mlx_would(server, tmp_path):
    srv, env = server
    log = tmp_path / "log"
    child = srv.spawn([VLLM_MLX, "--help"], dict(env, HOME=str(tmp_path)), str(log))
    assert child.wait(60) == 0 and "serve" in log.read_text()
    refused = srv.spawn([VLLM_MLX, "serve"], env, str(tmp_path / "refused"))  # no model: refused
    fresh = subprocess.run([VLLM_MLX, "serve"], capture_output=True, text=True, env=env)
    assert fresh.returncode != 0 and refused.wait(60) == fresh.returncode and refused.poll() == fresh.returncode
    said = (tmp_path / "refused").read_text().strip()
    assert said and said in fresh.stdout + fresh.stderr  # the same CLI, the same words


def test_signals_reach_the_child_and_wait_times_out(server, tmp_path):
    srv, env = server
    model = tmp_path / "no-model"
    model.mkdir()
    child = srv.spawn([VLLM_MLX, "serve", str(model), "--port", "1"], env, str(tmp_path / "log"))
    child.send_signal(signal.SIGSTOP)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)
    assert child.poll() is None
    child.kill()
    assert child.wait(60) == -signal.SIGKILL
    child.kill()  # a finished child: nothing to signal, no error


def test_one_fork_server_per_import_time_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(forkserver, "_slots", {})
    monkeypatch.setattr(forkserver, "MAX_FORK_SERVERS", 1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        a = forkserver.spawn([VLLM_MLX, "--help"], dict(env, HOME=str(tmp_path), VLLM_MLX_PERSIST_FAULT="x"),
                             str(tmp_path / "a"))
        b = forkserver.spawn([VLLM_MLX, "--help"], env, str(tmp_path / "b"))  # run-time keys differ only
        assert a is not None and b is not None and a._server is b._server
        assert a.wait(60) == 0 and b.wait(60) == 0
        # OpenBLAS reads its settings when it loads: another value needs another fork server (none left)
        other = "Sandybridge" if env.get("OPENBLAS_CORETYPE") == "Nehalem" else "Nehalem"
        assert forkserver.spawn([VLLM_MLX, "--help"], dict(env, OPENBLAS_CORETYPE=other),
                                str(tmp_path / "c")) is None
    finally:
        for slot in forkserver._slots.values():
            slot.server.close()


def test_a_child_dies_with_its_fork_server_and_is_still_waited_for(tmp_path):
    """A child whose fork server died (its caller killed with -9) dies too, so no server is left
    running; nobody reports its status: wait() sees it end in /proc (Server.stop's kill-then-wait
    would otherwise hang forever)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    srv = forkserver.ForkServer(env)
    log = tmp_path / "log"
    os.mkfifo(log)  # the child blocks opening its log until somebody reads it: alive until killed
    child = srv.spawn([VLLM_MLX, "--help"], env, str(log))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)  # alive while its fork server is
    srv.proc.kill()
    srv.proc.wait(10)
    assert child.wait(30) == forkserver.LOST_STATUS and child.poll() == forkserver.LOST_STATUS
    assert not srv.alive
