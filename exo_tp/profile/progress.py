"""A progress bar on stderr while the bench runs (only on a terminal: logs stay clean)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from tqdm import tqdm


class Progress:
    """Counts measurements; stages announce how many they will make with ``expect``."""

    def __init__(self, enabled: bool | None = None) -> None:
        self._on = sys.stderr.isatty() if enabled is None else enabled
        self._bar: tqdm | None = None

    def expect(self, steps: int) -> None:
        if self._bar is None:  # created on first use: no empty 0/0 bar
            self._bar = tqdm(
                total=steps,
                file=sys.stderr,
                disable=not self._on,
                leave=False,
                unit="step",
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]",
            )
        else:
            self._bar.total += steps
            self._bar.refresh()

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        if self._bar is None:
            self.expect(1)
        assert self._bar is not None
        self._bar.set_description_str(label, refresh=True)
        yield
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
