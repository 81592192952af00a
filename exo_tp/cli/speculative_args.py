"""`--num-draft-tokens` and `--prompt-lookup-ngram`: prompt-lookup speculative decoding, for
`exo-tp run` (the node's default for requests that do not say) and `exo-tp launch`;
`--draft-model` (drafts from a second model) and `--mtp` (from the checkpoint's MTP heads)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exo_tp.cli.args import non_negative_int, positive_int
from exo_tp.wire.assignment import MODEL_DRAFTS


def add_speculative_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    # mlx-lm's name for the drafts per step; its drafts come from a second model, ours from
    # the text itself (no model to load, no memory to find for it)
    p.add_argument(
        "--num-draft-tokens",
        type=non_negative_int,
        default=None,
        help="speculative decoding: tokens drafted per step (from earlier text, by "
        "--draft-model or by the MTP heads) and checked by the model in one step (0: off, the "
        f"default where no model drafts, {MODEL_DRAFTS} where one does; only while one request "
        "runs; requests may set their own num_draft_tokens)",
    )
    p.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="speculative decoding with drafts from the checkpoint's own multi-token "
        "prediction heads (Qwen 3.5/3.6, Qwen3-Next, GLM-5 ...), kept on the last stage's "
        "ranks (default: on where the checkpoint has them and the last stage computes on "
        f"GPUs; {MODEL_DRAFTS} drafts a step unless --num-draft-tokens says)",
    )
    p.add_argument(
        "--batch-drafts",
        choices=("auto", "on", "off"),
        default="auto",
        help="while several requests run, each drafts by prompt lookup and all are checked "
        "in one batched step (default auto: on where every rank of a one-stage plan computes "
        "on a GPU; on a CPU it costs more than it saves)",
    )
    p.add_argument(
        "--prompt-lookup-ngram",
        type=positive_int,
        default=3,
        help="the longest run of last tokens looked up in earlier text to draft what follows "
        "it (default: 3; shorter runs are tried when it does not occur)",
    )


def add_draft_model_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--draft-model",
        help="speculative decoding with drafts from this model (a name or folder, mlx_lm's "
        "flag): it must share the model's tokenizer; it runs whole beside the conductor "
        "(exo-tp run: on the conductor's node, which must have it)",
    )


def speculative_options(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """`exo-tp launch`'s speculative fields of ServingOptions, the draft model checked against
    the model first (a mismatch is one line here, not an error on every rank)."""
    from exo_tp.models.draft import check_draft
    from exo_tp.models.registry import resolve_model

    folder = None
    if args.draft_model:
        folder = resolve_model(args.draft_model)
        check_draft(model_dir, folder, args.draft_model)
    return _fields(args, str(Path(folder).resolve()) if folder else None)


def node_speculative_options(args: argparse.Namespace) -> dict[str, Any]:
    """`exo-tp run`'s. The draft model is checked where the conductor runs (it may be another
    node, with its own files): here only that this node knows the name, and a folder given
    here travels as its full path (nodes on this machine find it)."""
    from exo_tp.models.registry import resolve_model

    draft = args.draft_model
    if draft:
        folder = resolve_model(draft)
        if Path(draft).expanduser().exists():
            draft = str(Path(folder).resolve())
    return _fields(args, draft)


def _fields(args: argparse.Namespace, draft: str | None) -> dict[str, Any]:
    mtp = {None: "auto", True: "on", False: "off"}[args.mtp]
    return {
        "num_draft_tokens": args.num_draft_tokens,  # None: MODEL_DRAFTS where a model drafts
        "prompt_lookup_ngram": args.prompt_lookup_ngram,
        "draft_model": draft,
        "mtp": mtp,
        "batch_drafts": args.batch_drafts,
    }
