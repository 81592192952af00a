"""Stop sequences on streamed text: emit what is safe, hold back a possible partial match."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest one)

    def feed(self, text: str) -> str:
        """Text that can be emitted now; sets ``stopped`` once a stop sequence appeared."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            at, self.matched = min(hits)
            self.stopped = True
            self._pending = ""
            return buffer[:at]
        hold = max((self._overlap(buffer, s) for s in self.stops), default=0)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return "" if self.stopped else rest

    @staticmethod
    def _overlap(buffer: str, stop: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of ``stop``."""
        for n in range(min(len(buffer), len(stop) - 1), 0, -1):
            if buffer.endswith(stop[:n]):
                return n
        return 0
