"""The resident memory of a server process and its children, sampled on a thread (the bench's agents,
long and stall sections, the reliability campaigns)."""

from __future__ import annotations

import threading
import time
from typing import Optional


class RssSampler:
    """Samples the resident set size (process + children) of a pid on a thread; keeps the peak."""

    def __init__(self, interval: float = 0.1, window: float = 0.5):
        self.interval, self.window = interval, window
        self.pid: Optional[int] = None
        self.peak = 0
        self.series: list[tuple[float, int]] = []  # (seconds since start(), max bytes in the window)
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self, pid: int) -> "RssSampler":
        self.pid = pid
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def watch(self, pid: int) -> None:
        """Follow a new process (after a restart); the peak carries over."""
        self.pid = pid

    def rss(self) -> int:
        import psutil

        try:
            p = psutil.Process(self.pid)
            return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except (psutil.Error, TypeError):
            return 0

    def _run(self) -> None:
        window_end, window_max = self.window, 0
        while not self._stop.is_set():
            v = self.rss()
            self.peak = max(self.peak, v)
            window_max = max(window_max, v)
            t = time.perf_counter() - self._t0
            if t >= window_end:  # one point per window: its maximum
                self.series.append((round(t, 2), window_max))
                window_end, window_max = t + self.window, 0
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak
