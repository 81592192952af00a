"""`exo-tp run`'s generation defaults: what a request that omits a field gets (mlx_lm.server's
flags, names and defaults)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from exo_tp.cli.args import json_object, non_negative_float, non_negative_int, positive_int
from exo_tp.cli.image_url_args import add_image_url_args, image_url_policy

if TYPE_CHECKING:
    from exo_tp.api.core.defaults import GenerationDefaults


# GenerationDefaults' fields and the `exo-tp run` flags that set them (mlx_lm.server's names)
_FLAGS = {
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "max_tokens": "--max-tokens",
    "chat_template_args": "--chat-template-args",
}


def add_generation_defaults(p: argparse.ArgumentParser) -> None:
    """What a request that omits a field gets: mlx_lm.server's flags, names and defaults."""
    from exo_tp.api.core.defaults import GenerationDefaults

    default = GenerationDefaults()
    group = p.add_argument_group("generation defaults (for requests that omit the field)")
    group.add_argument(
        _FLAGS["temperature"],
        type=non_negative_float,
        default=default.temperature,
        help=f"sampling temperature (default: {default.temperature}, greedy)",
    )
    group.add_argument(
        _FLAGS["top_p"],
        type=non_negative_float,
        default=default.top_p,
        help=f"nucleus sampling top-p (default: {default.top_p}, off)",
    )
    group.add_argument(
        _FLAGS["top_k"],
        type=non_negative_int,
        default=default.top_k,
        help=f"top-k sampling (default: {default.top_k}, off)",
    )
    group.add_argument(
        _FLAGS["min_p"],
        type=non_negative_float,
        default=default.min_p,
        help=f"min-p sampling (default: {default.min_p}, off)",
    )
    group.add_argument(
        _FLAGS["max_tokens"],
        type=positive_int,
        default=default.max_tokens,
        help=f"maximum tokens to generate (default: {default.max_tokens})",
    )
    group.add_argument(
        _FLAGS["chat_template_args"],
        type=json_object,
        default=default.chat_template_args,
        help="JSON object of extra chat template arguments, e.g. '{\"enable_thinking\": false}'",
    )
    add_image_url_args(p)  # GenerationDefaults.image_urls


def _flag_values(args: argparse.Namespace) -> dict[str, object]:
    """Each GenerationDefaults field's value from its flag."""
    return {
        field: getattr(args, flag.removeprefix("--").replace("-", "_"))
        for field, flag in _FLAGS.items()
    }


def generation_defaults(args: argparse.Namespace) -> GenerationDefaults:
    from pydantic import ValidationError

    from exo_tp.api.core.defaults import GenerationDefaults
    from exo_tp.errors import ExoTpError

    try:
        values = {**_flag_values(args), "image_urls": image_url_policy(args)}
        return GenerationDefaults.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0])
        raise ExoTpError(f"{_FLAGS.get(field, field)}: {first['msg']}") from None
