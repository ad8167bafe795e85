"""`vllm-mlx-persist reliability --campaigns server_crash`: SIGKILL a real server at random moments
(mid-request, right after a response, at a chosen write step through the store's fault hook) with
several agents in flight; one server lifetime per kill. Every completed turn must be covered by the
agent's next turn's cached_tokens, no request may fail while the server is up, and every reply must
equal a never-killed reference server's reply to the same conversation.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from ...faults import ENV as FAULT_ENV
from ..serving import Server
from .server_kit import BATCH_INVARIANT_ENV, OPTIONS, TIMEOUT_S, Conv, HttpError, chat, shared


def server_crash_campaign(trials: int, seed: int, work: Path, n_agents: int = 4) -> dict:
    sh = shared(work)
    model = str(sh.model)
    rng = random.Random(seed)
    srv = Server(sh.model, work / "server-crash", options=OPTIONS)
    convs = [Conv(f"crash{k}") for k in range(n_agents)]
    failures: list[dict] = []
    st: dict[str, Any] = {"completed_turns": 0, "turns_checked_across_a_kill": 0, "requests_killed_in_flight": 0,
                          "modes": {}, "write_point_kills": 0, "replies_compared": 0}
    modes = ["mid-request", "after-response", "write-point"]
    for trial in range(trials + 1):  # the last lifetime only checks every agent's next turn
        final = trial == trials
        mode = "final-check" if final else modes[trial % 3]
        point = rng.randint(1, 60) if mode == "write-point" else None
        srv.extra_env = {**BATCH_INVARIANT_ENV, **({FAULT_ENV: f"kill@{point}"} if point else {})}
        try:
            srv.start()
        except RuntimeError as e:
            failures.append({"trial": trial, "seed": seed, "mode": mode, "problem": f"restart failed: {str(e)[-300:]}"})
            break
        proc = srv.proc
        killed, stop = threading.Event(), threading.Event()
        responses, in_flight = [0], [0]
        crossed = {c.name: True for c in convs}  # the next turn of each agent spans a kill
        lock = threading.Lock()

        def run(c: Conv) -> None:
            while not stop.is_set():
                msgs = c.next_messages()
                try:
                    ref = sh.reply(c.agent, msgs)
                except Exception as e:  # the reference must not fail either
                    failures.append({"trial": trial, "seed": seed, "problem": f"reference server: {e}"})
                    return
                if stop.is_set():
                    return
                with lock:
                    in_flight[0] += 1
                try:
                    text, cached, prompt = chat(srv_url, model, msgs, c.agent)
                except Exception as e:
                    dead = killed.is_set()
                    if not dead and not isinstance(e, HttpError):
                        try:
                            proc.wait(3)
                            dead = True
                        except subprocess.TimeoutExpired:
                            pass
                    if dead:
                        with lock:
                            st["requests_killed_in_flight"] += 1
                    else:
                        failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent,
                                         "turn": c.turn, "problem": f"request failed with the server up: {e}"[:400]})
                    return
                finally:
                    with lock:
                        in_flight[0] -= 1
                st["replies_compared"] += 1
                if text != ref:
                    failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent, "turn": c.turn,
                                     "problem": f"reply {text!r} differs from the never-killed server's {ref!r}"})
                if c.turn > 0 and cached < c.last_prompt:
                    failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent, "turn": c.turn,
                                     "problem": f"completed turn lost: cached {cached} < {c.last_prompt} tokens of "
                                                f"the turn before" + (" (across a kill)" if crossed[c.name] else "")})
                if c.turn > 0 and crossed[c.name]:
                    st["turns_checked_across_a_kill"] += 1
                crossed[c.name] = False
                c.complete(msgs, ref, prompt)
                with lock:
                    st["completed_turns"] += 1
                    responses[0] += 1
                    if mode == "after-response" and responses[0] >= target and not killed.is_set():
                        killed.set()
                        proc.send_signal(signal.SIGKILL)
                if final:
                    return

        srv_url = srv.url
        target = rng.randint(1, n_agents)
        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in convs]
        for t in threads:
            t.start()
        deadline = time.time() + 90
        if mode == "mid-request":
            while in_flight[0] == 0 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 1.0))
            killed.set()
            proc.send_signal(signal.SIGKILL)
        elif mode == "write-point":
            try:
                proc.wait(60)
                st["write_point_kills"] += 1
            except subprocess.TimeoutExpired:
                killed.set()
        elif mode == "after-response":
            while not killed.is_set() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.005)
        if final:
            for t in threads:
                t.join(TIMEOUT_S + 10)
        stop.set()
        srv.stop(signal.SIGKILL)
        for t in threads:
            t.join(TIMEOUT_S + 10)
            if t.is_alive():
                failures.append({"trial": trial, "seed": seed, "mode": mode, "problem": "a client hung past its time-out"})
        st["modes"][mode] = st["modes"].get(mode, 0) + 1
    if st["turns_checked_across_a_kill"] == 0:
        failures.append({"seed": seed, "problem": "no turn was checked across a kill: the campaign checked nothing"})
    return {"trials": trials, "failures": len(failures), "failure_cases": failures[:20], **st}
