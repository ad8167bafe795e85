"""`vllm-mlx-persist reliability --campaigns storm`: 32 concurrent clients against a real server:
agents, the same agent in parallel, aborted and disconnected streams, invalid bodies and ids; the
server stays up, nothing hangs, and afterwards every agent answers exactly as a fresh server given the
same history cold.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

from ..serving import Server
from .server_kit import OPTIONS, TIMEOUT_S, chat, request, run_for, shared, user_text


BAD_IDS = ["", "../etc/passwd", "a" * 300, "bad\x00id", "sp ace", "x/y", "-lead", 12345, ["list"], {"d": 1}]
BAD_HEADER_IDS = ["../etc/passwd", "a" * 300, "sp ace", "x/y", "-lead", "%00"]
BAD_BODIES = [b"{not json", b"", b"[]", b'{"messages": "nope"}', b'{"model": 1, "messages": [{"role": 5}]}',
              b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', b"\xff\xfe" * 50,
              b"[" * 10000]


def _abort_stream(url: str, model: str, messages: list, agent: str, rng: random.Random) -> None:
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 32, "temperature": 0.0, "stream": True,
                       "metadata": {"agent_id": agent}}).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if rng.random() < 0.5:
            s.recv(rng.randint(1, 4096))  # some of the stream, then hang up
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST


def storm_campaign(seconds: int, seed: int, work: Path, clients: int = 32, n_agents: int = 8) -> dict:
    sh = shared(work)
    model = str(sh.model)
    srv = Server(sh.model, work / "storm-home", options=OPTIONS)
    srv.start()
    failures: list[dict] = []
    counts: dict[str, dict[str, int]] = {}
    histories: dict[str, list[list[dict]]] = {f"storm{k}": [] for k in range(n_agents)}  # completed conversations
    lock = threading.Lock()
    stop = threading.Event()
    slowest = [0.0]

    def count(kind: str, outcome: str) -> None:
        with lock:
            counts.setdefault(kind, {}).setdefault(outcome, 0)
            counts[kind][outcome] += 1

    def client(j: int) -> None:
        rng = random.Random(seed * 1000 + j)
        mine: dict[str, list[dict]] = {}
        while not stop.is_set():
            kind = rng.choices(["turn", "abort", "disconnect", "bad_body", "bad_id"], [6, 1, 1, 1, 1])[0]
            agent = f"storm{rng.randrange(n_agents)}"
            hist = mine.setdefault(agent, [])
            msgs = hist + [{"role": "user", "content": user_text(agent, len(hist) // 2, 20)}]
            t = time.perf_counter()
            try:
                if kind == "turn":
                    text, _, _ = chat(srv.url, model, msgs, agent)
                    mine[agent] = msgs + [{"role": "assistant", "content": text}] if len(hist) < 8 else []
                    with lock:
                        histories[agent].append(msgs + [{"role": "assistant", "content": text}])
                    count(kind, "200")
                elif kind == "abort":
                    _abort_stream(srv.url, model, msgs, agent, rng)
                    count(kind, "hung up")
                elif kind == "disconnect":
                    try:
                        chat(srv.url, model, msgs, agent, timeout=rng.uniform(0.01, 0.3))
                        count(kind, "finished first")
                    except (socket.timeout, TimeoutError):
                        count(kind, "hung up")
                elif kind == "bad_body":
                    code, _ = request(srv.url, "/v1/chat/completions", rng.choice(BAD_BODIES))
                    count(kind, str(code))
                    if code >= 500:
                        failures.append({"seed": seed, "client": j, "problem": f"invalid body answered {code}"})
                else:
                    if rng.random() < 0.5:
                        bad = rng.choice(BAD_IDS)
                        body = {"model": model, "messages": msgs, "max_tokens": 4, "metadata": {"agent_id": bad}}
                        code, _ = request(srv.url, "/v1/chat/completions", body)
                    else:
                        bad = rng.choice(BAD_HEADER_IDS)
                        code, _ = request(srv.url, "/v1/chat/completions", {"model": model, "messages": msgs,
                                          "max_tokens": 4}, headers={"X-Agent-ID": bad})
                    count(kind, str(code))
                    if code != 400:
                        failures.append({"seed": seed, "client": j, "problem": f"bad agent id {bad!r} answered {code}"})
            except (socket.timeout, TimeoutError) as e:
                failures.append({"seed": seed, "client": j, "kind": kind, "problem": f"hung past {TIMEOUT_S}s: {e}"})
            except Exception as e:
                count(kind, type(e).__name__)
                if kind == "turn":
                    failures.append({"seed": seed, "client": j, "problem": f"turn failed: {e}"[:300]})
            with lock:
                slowest[0] = max(slowest[0], time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in range(clients)]
    for _ in range(run_for(threads, seconds, stop)):
        failures.append({"seed": seed, "problem": "a client thread hung"})
    alive = srv.proc is not None and srv.proc.poll() is None
    verified = 0
    try:
        if not alive or srv.get_json("/health").get("status") != "healthy":
            failures.append({"seed": seed, "problem": "the server is down after the storm"})
        else:
            # Every agent's cache is one it really computed: its next turn after each of a few of its
            # real conversations answers exactly as a fresh server given that history cold.
            rng = random.Random(seed)
            for agent, convs in histories.items():
                for h in rng.sample(convs, min(3, len(convs))) + convs[-1:]:
                    msgs = h + [{"role": "user", "content": f"{agent} after the storm"}]
                    got, cached, _ = chat(srv.url, model, msgs, agent)
                    want = sh.cold(msgs)
                    verified += 1
                    if got != want:
                        failures.append({"seed": seed, "agent": agent, "problem": f"after the storm: {got!r} "
                                         f"(cached {cached}) differs from a cold server's {want!r}"})
    finally:
        srv.stop()
    return {"trials": sum(sum(v.values()) for v in counts.values()), "failures": len(failures),
            "failure_cases": failures[:20], "clients": clients, "seconds_run": seconds, "requests": counts,
            "slowest_request_s": round(slowest[0], 2), "agents_verified_after": verified}
