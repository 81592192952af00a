"""The last stage's final norm, recording its output per position for the MTP heads.

The heads draft from the model's normed last hidden state (what the LM head reads, as
mlx-vlm's drafters take it) at each position, so every position the model runs while one
stream is alone in the batch is recorded: its prompt's chunks, its plain steps, its verify
steps (whose rejected positions the speculative step cuts away again). A call over several
rows (other streams in the batch) clears the record: those states belong to no one stream,
and the heads then start again from the next positions of a lone stream.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

MOST_ROWS = 4096  # positions kept unread (a stream that never drafts must not grow it)


class _Rows:
    """Outside the module tree (an array attribute of a Module would become a parameter)."""

    def __init__(self) -> None:
        self.chunks: list[mx.array] = []
        self.count = 0  # rows held
        self.total = 0  # rows recorded since the record was cleared (some maybe let go)


class HiddenTap(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self._rows = _Rows()

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.norm(x, *args, **kwargs)
        if out.ndim != 3 or out.shape[0] != 1:
            self.clear()
            return out
        rows = self._rows
        rows.chunks.append(out[0])
        rows.count += out.shape[1]
        rows.total += out.shape[1]
        while rows.count - rows.chunks[0].shape[0] >= MOST_ROWS:  # the oldest let go
            rows.count -= rows.chunks.pop(0).shape[0]
        return out

    def size(self) -> int:
        """Rows recorded since the record was last cleared."""
        return self._rows.total

    def cut(self, rows: int) -> None:
        """Keep the first ``rows`` recorded (a verify step took the positions after back)."""
        held = self._rows
        drop = held.total - rows
        held.total = rows
        while drop > 0 and held.chunks:
            last = held.chunks.pop()
            if last.shape[0] > drop:
                held.chunks.append(last[: last.shape[0] - drop])
            taken = min(drop, last.shape[0])
            held.count, drop = held.count - taken, drop - taken

    def clear(self) -> None:
        self._rows.chunks, self._rows.count, self._rows.total = [], 0, 0

    def take(self) -> mx.array | None:
        """The recorded states (positions, hidden), the latest positions last; cleared."""
        chunks = self._rows.chunks
        self.clear()
        return mx.concatenate(chunks) if chunks else None
