"""Logs that survive abuse: repeated records of one kind are shown a few times per window,
then counted and summarised in one line ("... ×12,345 more in 60 s: too many open files").

A flood of identical errors (a failing ``accept()``, a refused connection per client) used to
grow a node's log by hundreds of megabytes a minute (issue #21); with this filter it grows by
a few lines a minute. Records are "of one kind" when their logger, level, message template
(digits ignored, so addresses and counts do not split them) and exception type agree.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

_DIGITS = re.compile(r"\d+")


@dataclass
class _Kind:
    start: float
    shown: int = 0
    hidden: int = 0
    last: str = ""
    name: str = ""
    level: int = logging.INFO


class FloodFilter(logging.Filter):
    """Let ``burst`` records of each kind through per ``window`` seconds; count the rest and
    write one summary line per kind when its window ends (at the next record logged)."""

    def __init__(self, handler: logging.Handler, window: float = 60.0, burst: int = 5):
        super().__init__()
        self._handler, self.window, self.burst = handler, window, burst
        self._kinds: dict[tuple[str, int, str, str], _Kind] = {}
        self._lock = threading.Lock()
        self._next_flush = 0.0

    @staticmethod
    def _key(record: logging.LogRecord) -> tuple[str, int, str, str]:
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return record.name, record.levelno, _DIGITS.sub("#", template)[:300], exc

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "flood_summary", False):
            return True
        now = time.monotonic()
        summaries: list[logging.LogRecord] = []
        with self._lock:
            if now >= self._next_flush:
                summaries = self._expired(now)
                self._next_flush = now + min(1.0, self.window / 2)
            key = self._key(record)
            kind = self._kinds.get(key)
            if kind is None or now - kind.start >= self.window:
                if kind is not None and kind.hidden:
                    summaries.append(self._summary(kind, now))
                kind = self._kinds[key] = _Kind(start=now, name=record.name, level=record.levelno)
            passes = kind.shown < self.burst
            if passes:
                kind.shown += 1
            else:
                kind.hidden += 1
                kind.last = _first_line(record)
        for summary in summaries:
            self._handler.handle(summary)
        return passes

    def _expired(self, now: float) -> list[logging.LogRecord]:
        out = []
        for key, kind in list(self._kinds.items()):
            if now - kind.start >= self.window:
                if kind.hidden:
                    out.append(self._summary(kind, now))
                del self._kinds[key]
        return out

    def flush_summaries(self) -> None:
        """Write the summaries of every kind now (e.g. at exit)."""
        with self._lock:
            now = time.monotonic()
            out = [self._summary(k, now) for k in self._kinds.values() if k.hidden]
            self._kinds.clear()
        for summary in out:
            self._handler.handle(summary)

    @staticmethod
    def _summary(kind: _Kind, now: float) -> logging.LogRecord:
        seconds = max(1.0, now - kind.start)
        record = logging.LogRecord(
            kind.name,
            kind.level,
            __file__,
            0,
            "%s ×%s more in %.0f s (not shown; the log keeps the first few of each kind)",
            (kind.last, f"{kind.hidden:,}", seconds),
            None,
        )
        record.flood_summary = True
        return record


def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a bad format string: the template is still something
        text = str(record.msg)
    line = text.splitlines()[0] if text else ""
    if record.exc_info and record.exc_info[1] is not None:
        line += f": {record.exc_info[1]}"
    return line[:300]


def install(window: float = 60.0, burst: int = 5) -> list[FloodFilter]:
    """Put a `FloodFilter` on every handler of the root logger (after basicConfig)."""
    filters = []
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, FloodFilter) for f in handler.filters):
            flood = FloodFilter(handler, window, burst)
            handler.addFilter(flood)
            filters.append(flood)
    return filters
