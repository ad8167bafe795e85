"""A partition harness: a TCP proxy in front of Redis that a test or a campaign cuts and heals.

    proxy = PartitionProxy("127.0.0.1", redis_port)     # listens on a free local port at once
    url = proxy.url                                     # give this to one server's FleetSettings
    proxy.cut()     # every open connection is closed; new ones are accepted and closed at once
    proxy.heal()    # new connections reach Redis again (redis-py reconnects on its next command)
    proxy.close()

One proxy per server is a partition of that server alone: the others keep reaching Redis. Stdlib only
(threads and sockets), never imported by the runtime. Bounds: at most `max_connections` connections
at once (more are closed on accept), each relayed by two threads with 64 KiB buffers; `cut()` and
`close()` never wait on a socket (they shut sockets down; the relaying threads end by themselves).
"""

from __future__ import annotations

import socket
import threading
from typing import Optional

_CHUNK = 1 << 16


class PartitionProxy:
    """A TCP relay to (`host`, `port`) that can be cut and healed (see the module docstring)."""

    def __init__(self, host: str, port: int, max_connections: int = 64):
        self.target = (host, port)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self._open: set[socket.socket] = set()
        self.accepted = self.refused = 0  # connections relayed, and closed at once (cut or full)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="partition-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_cut(self) -> bool:
        with self._lock:
            return self._cut

    def cut(self) -> None:
        """Partition: close every open connection; refuse new ones until `heal`."""
        with self._lock:
            self._cut = True
            victims = list(self._open)
            self._open.clear()
        for s in victims:
            _shut(s)

    def heal(self) -> None:
        """End the partition: new connections reach Redis again."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self.cut()
        with self._lock:
            self._closed = True
        _shut(self._listener)
        self._thread.join(5)

    # ---- the relay ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refuse = self._cut or self._closed or len(self._open) >= self.max_connections
                if refuse:
                    self.refused += 1
            if refuse:
                _shut(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                if self._cut or self._closed:  # cut while connecting
                    late = True
                else:
                    late = False
                    self.accepted += 1
                    self._open.update((client, upstream))
            if late:
                _shut(client)
                _shut(upstream)
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True, name="partition-relay").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.discard(src)
            self._open.discard(dst)
        _shut(src)
        _shut(dst)


def _shut(s: Optional[socket.socket]) -> None:
    if s is None:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
