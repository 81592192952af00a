"""Image prompts on a rank: the span of a prompt up to its last image, run from a registry.

mlx-lm's batch generator moves token ids only: prompts, chunks, caches, merges. An image's rows
must instead carry the tower's features and, for M-RoPE families, 3-D positions. So each rank
gives a prompt's span (VisionPrompt.span) token ids past the vocabulary, ``vocab_size + k``,
one per position, numbered from a counter that never goes back (the same ids mean the same
content for the prompt cache, on every rank alike: every rank registers the same Inserts in the
same order). The model's wrappers (exo_tp.vision.text_model) map such ids back inside the graph,
without reading anything on the host:

- the embedding looks up the real token (an image position contributes nothing), and the rank
  holding the tower adds the image features there, before the embedding's one all-reduce: the
  sum is mlx-vlm's merged embedding exactly (each position has one non-zero term);
- per-layer tables (Gemma 4) look up the real token, id 0 at image positions as mlx-vlm does;
- M-RoPE attention rotates the span's rows by their 3-D positions;
- deepstack (Qwen3-VL): the tower's rank adds text layer k's visual rows into its partial sum
  of that layer's MLP, before the layer's all-reduce: every rank's hidden state gets them.

Entries live while a sequence uses them, then a few are kept (least recently used first out)
so that the same image prompt again reuses its ids, hence its prompt-cache entry and features.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from exo_tp.wire.vision import VisionPrompt

KEEP_UNUSED = 8  # entries kept for reuse once no sequence uses them


@dataclass
class _Entry:
    base: int  # its first registered id
    tokens: np.ndarray  # (span,) real token ids
    image: np.ndarray  # (span,) bool: the tower's positions
    positions: np.ndarray | None  # (3, span) int32, M-RoPE only
    features: mx.array | None  # (span, hidden): the tower's rows (tower rank only)
    deepstack: mx.array | None  # (layers, span, hidden): deepstack rows (tower rank only)
    users: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Tables:
    """The live entries side by side, as arrays the graph indexes."""

    bases: mx.array  # (E,)
    lengths: mx.array  # (E,)
    starts: mx.array  # (E,) each entry's first row in the tables below
    tokens: mx.array  # (N,) real ids
    image: mx.array  # (N,) bool
    positions: mx.array | None  # (3, N)
    features: mx.array | None  # (N, hidden)
    deepstack: mx.array | None  # (layers, N, hidden)


class VisionRegistry:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._next = vocab_size
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._of_uid: dict[int, str] = {}
        self._tables: _Tables | None = None
        self.current_ids: mx.array | None = None  # the running forward's ids (text_model)
        self.tower: object | None = None  # exo_tp.vision.tower.Tower on the tower's rank

    @property
    def empty(self) -> bool:
        return self._tables is None

    # ---- changes (every rank alike, in Insert order) ----------------------------------------

    def encode(self, uid: int, tokens: list[int], vision: VisionPrompt) -> list[int]:
        """The prompt as this rank runs it: the span's ids registered, the rest as they are."""
        entry = self._entries.get(vision.key)
        if entry is None:
            entry = self._register(tokens, vision)
        self._entries.move_to_end(vision.key)
        entry.users.add(uid)
        self._of_uid[uid] = vision.key
        span = len(entry.tokens)
        return [entry.base + i for i in range(span)] + tokens[span:]

    def _register(self, tokens: list[int], vision: VisionPrompt) -> _Entry:
        span = vision.span
        if not 0 < span < len(tokens):
            raise ValueError(f"an image span of {span} tokens in a prompt of {len(tokens)}")
        real = np.asarray(tokens[:span], dtype=np.int32)
        positions = None
        if vision.positions is not None:
            positions = vision.positions.numpy().astype(np.int32)
            if positions.shape != (3, span):
                raise ValueError(f"positions of shape {positions.shape} for a span of {span}")
        features = deepstack = None
        if self.tower is not None:
            features, deepstack = self.tower.features(tokens, vision)  # type: ignore[attr-defined]
        image = real == vision.image_token
        entry = _Entry(self._next, real, image, positions, features, deepstack)
        self._next += span
        self._entries[vision.key] = entry
        self._evict()
        self._rebuild()
        return entry

    def release(self, uid: int) -> None:
        """A sequence left the batch (removed or finished)."""
        key = self._of_uid.pop(uid, None)
        if key is None:
            return
        self._entries[key].users.discard(uid)
        if self._evict():
            self._rebuild()

    def _evict(self) -> bool:
        unused = [k for k, e in self._entries.items() if not e.users]
        gone = unused[: max(0, len(unused) - KEEP_UNUSED)]
        for key in gone:
            del self._entries[key]
        return bool(gone)

    def _rebuild(self) -> None:
        entries = list(self._entries.values())
        if not entries:
            self._tables = None
            return
        lengths = [len(e.tokens) for e in entries]
        starts = np.cumsum([0, *lengths[:-1]])
        tokens = np.concatenate([e.tokens for e in entries])
        image = np.concatenate([e.image for e in entries])
        positions = None
        if all(e.positions is not None for e in entries):
            positions = mx.array(np.concatenate([e.positions for e in entries], axis=1))  # type: ignore[misc]
        features = None
        if all(e.features is not None for e in entries):
            features = mx.concatenate([e.features for e in entries])  # type: ignore[misc]
        deepstack = None
        if all(e.deepstack is not None for e in entries):
            deepstack = mx.concatenate([e.deepstack for e in entries], axis=1)  # type: ignore[misc]
        self._tables = _Tables(
            bases=mx.array([e.base for e in entries], dtype=mx.int32),
            lengths=mx.array(lengths, dtype=mx.int32),
            starts=mx.array(starts, dtype=mx.int32),
            tokens=mx.array(tokens),
            image=mx.array(image),
            positions=positions,
            features=features,
            deepstack=deepstack,
        )

    # ---- inside the graph -------------------------------------------------------------------

    def _rows(self, ids: mx.array) -> tuple[mx.array, mx.array]:
        """(registered?, its row in the tables) for each id."""
        t = self._tables
        assert t is not None
        offset = ids.astype(mx.int32)[..., None] - t.bases
        inside = (offset >= 0) & (offset < t.lengths)
        rows = mx.sum(mx.where(inside, offset + t.starts, 0), axis=-1)
        return mx.any(inside, axis=-1), rows

    def real_tokens(self, ids: mx.array, image_as: int | None = None) -> mx.array:
        """The ids with registered ones read back; image positions as ``image_as`` if given."""
        if self._tables is None:
            return ids
        registered, rows = self._rows(ids)
        real = self._tables.tokens[rows]
        if image_as is not None:
            real = mx.where(self._tables.image[rows], image_as, real)
        return mx.where(registered, real, ids).astype(ids.dtype)

    def image_rows(self, ids: mx.array) -> mx.array:
        """True where an id is an image position of the registry."""
        if self._tables is None:
            return mx.zeros(ids.shape, dtype=mx.bool_)
        registered, rows = self._rows(ids)
        return registered & self._tables.image[rows]

    def features(self, ids: mx.array, dtype: mx.Dtype) -> mx.array | None:
        """The tower's rows at image positions, zeros elsewhere (the tower's rank only)."""
        t = self._tables
        if t is None or t.features is None:
            return None
        registered, rows = self._rows(ids)
        where = (registered & t.image[rows])[..., None]
        return mx.where(where, t.features[rows].astype(dtype), mx.zeros((1,), dtype=dtype))

    def deepstack(self, ids: mx.array, layer: int, dtype: mx.Dtype) -> mx.array | None:
        """Text layer ``layer``'s deepstack rows at image positions, zeros elsewhere (the
        tower's rank only; None past the tower's deepstack layers)."""
        t = self._tables
        if t is None or t.deepstack is None or layer >= t.deepstack.shape[0]:
            return None
        registered, rows = self._rows(ids)
        where = (registered & t.image[rows])[..., None]
        return mx.where(where, t.deepstack[layer][rows].astype(dtype), mx.zeros((1,), dtype=dtype))

    def positions(self, ids: mx.array, offset: mx.array | int) -> tuple[mx.array, mx.array]:
        """(3, B, L) M-RoPE positions (registered rows' own; others at the cache offset in all
        three sections), and which rows of the batch hold any registered id."""
        t = self._tables
        assert t is not None and t.positions is not None
        registered, rows = self._rows(ids)
        length = ids.shape[1]
        start = offset if isinstance(offset, int) else offset.reshape(-1, 1)
        plain = mx.broadcast_to(start + mx.arange(length)[None], ids.shape).astype(mx.int32)
        mine = t.positions[:, rows]  # (3, B, L)
        return mx.where(registered[None], mine, plain[None]), mx.any(registered, axis=1)
