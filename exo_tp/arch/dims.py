"""The names of the split dimensions: what a table's rules, a plan's spans, the cost model and
the loader agree on (pure: no MLX).

``Dim`` is a str-mixin Enum (Python 3.10 has no StrEnum): a member equals, hashes and
serializes as its old bare string, so plans, manifests and wire messages keep their bytes,
while a pydantic field typed with it (or one of the narrowed aliases below) refuses a typo
when the model is built instead of when a lookup misses.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import AfterValidator


class Dim(str, Enum):
    """A split dimension: heads of one kind, the vocabulary, or a feed-forward kind."""

    Q_HEADS = "q_heads"
    # KV heads as held per rank (possibly replicated, never split)
    KV_HEADS = "kv_heads"
    # query heads per local KV slot (a count only: never split)
    REPEATS = "repeats"
    # heads of recurrent linear-attention layers (ModelSpec.linear_attention), split on their own
    LINEAR_HEADS = "linear_heads"
    VOCAB = "vocab"
    # Feed-forward kinds (ModelSpec.ffn_sizes): every one a producer of that dict can name.
    FFN = "ffn"
    # Gemma 4's KV-shared layers' double-wide MLP
    FFN_WIDE = "ffn_wide"
    EXPERT_FFN = "expert_ffn"
    SHARED_EXPERT_FFN = "shared_expert_ffn"

    def __str__(self) -> str:
        # the bare name in messages and f-strings on every Python version (3.12 changed
        # format() of mixed-in enums to str())
        return self.value

    def __repr__(self) -> str:
        # as the bare string read: containers of dims print as they did (`exo-tp plan` shows
        # ffn_sizes as a dict; error messages quote dims with !r)
        return repr(self.value)


ATTENTION_HEAD_DIMS = (Dim.Q_HEADS, Dim.KV_HEADS)
HEAD_DIMS = (*ATTENTION_HEAD_DIMS, Dim.LINEAR_HEADS)
FFN_DIMS = (Dim.FFN, Dim.FFN_WIDE, Dim.EXPERT_FFN, Dim.SHARED_EXPERT_FFN)


def _one_of(kinds: tuple[Dim, ...], what: str) -> AfterValidator:
    def check(dim: Dim) -> Dim:
        if dim not in kinds:
            raise ValueError(f"{dim} is no {what} ({', '.join(kinds)})")
        return dim

    return AfterValidator(check)


# Narrowed for fields that only some dimensions make sense in.
FfnDim = Annotated[Dim, _one_of(FFN_DIMS, "feed-forward kind")]
AttentionHeadDim = Annotated[Dim, _one_of(ATTENTION_HEAD_DIMS, "attention head dimension")]
# what a count attribute may follow: heads, or query heads per KV slot
CountDim = Annotated[Dim, _one_of((*HEAD_DIMS, Dim.REPEATS), "counted dimension")]
# what a weight may be split along: heads or FFN rows
SplitDim = Annotated[Dim, _one_of((*HEAD_DIMS, *FFN_DIMS), "weight split dimension")]
