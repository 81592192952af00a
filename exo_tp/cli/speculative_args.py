"""`--num-draft-tokens` and `--prompt-lookup-ngram`: prompt-lookup speculative decoding, for
`exo-tp run` (the node's default for requests that do not say) and `exo-tp launch`."""

from __future__ import annotations

import argparse

from exo_tp.cli.args import non_negative_int, positive_int


def add_speculative_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    # mlx-lm's name for the drafts per step; its drafts come from a second model, ours from
    # the text itself (no model to load, no memory to find for it)
    p.add_argument(
        "--num-draft-tokens",
        type=non_negative_int,
        default=0,
        help="prompt-lookup speculative decoding: tokens drafted per step from earlier text "
        "and checked by the model in one step (0: off; greedy requests only, and only while "
        "one request runs; requests may set their own num_draft_tokens)",
    )
    p.add_argument(
        "--prompt-lookup-ngram",
        type=positive_int,
        default=3,
        help="the longest run of last tokens looked up in earlier text to draft what follows "
        "it (default: 3; shorter runs are tried when it does not occur)",
    )
