"""Command-line flags for every EngineConfig field, shared by the scripts.

`add_engine_args(parser)` adds `--config` plus one `--flag-name` per config field (with the
field's default and comment as help); `engine_config_from_args(args)` builds the
EngineConfig: YAML preset first, then only the flags the user actually gave.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from typing import Any

from jaxcb.config import _SECTIONS, EngineConfig, field_type, flat_fields

_HELP_OVERRIDES = {
    "model": "Hugging Face model directory (config.json + *.safetensors); default: the "
    "built-in tiny random-weight model",
    "token_buckets": "precompiled token buckets, e.g. '16,32,64'; default: powers of two up "
    "to max_num_batched_tokens",
}


def _field_comments() -> dict[str, str]:
    """The trailing `# comment` of each field in config.py, used as --help text."""
    comments: dict[str, str] = {}
    for cls in (EngineConfig, *_SECTIONS.values()):
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): [^=]+=.*#\s*(.+)$", line)
            if m:
                comments[m.group(1)] = m.group(2).strip()
    return comments


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, help="YAML preset (configs/*.yaml); flags given override it"
    )
    comments = _field_comments()
    group = parser.add_argument_group("engine config (any field of EngineConfig)")
    for name, (section, f) in flat_fields().items():
        owner = _SECTIONS[section] if section else EngineConfig
        hint = field_type(f, owner)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = _HELP_OVERRIDES.get(name) or comments.get(name, "")
        where = f"{section}.{name}" if section else name
        kwargs: dict[str, Any] = dict(
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{text} [{where}; default: {default}]",
            metavar=name.upper(),
        )
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from --config and the config flags that were given (ValueError if bad)."""
    given = {name: getattr(args, name) for name in flat_fields() if hasattr(args, name)}
    if getattr(args, "config", None):
        return EngineConfig.from_yaml(args.config, **given)
    return EngineConfig.from_dict(None, **given)
