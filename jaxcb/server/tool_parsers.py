"""Reading tool calls out of a model's text, whole or while it grows (`--tool-call-parser`).

Every reader here works on a prefix of the output as well as on all of it, and gives each
call's arguments as the model's own text of them (not parsed and written again): the text
of a longer prefix only ever extends what a shorter one gave, so a stream can send the
arguments as deltas while they are generated and the deltas join to the arguments of the
whole output. A call is known once its name is; an output cut off inside the arguments
(max_tokens) still gives the call, with the arguments it got (as OpenAI and vLLM do).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in
  the text (Hermes, Qwen 2.5 / 3, SmolLM's ChatML); the rest is content.
- `llama3_json`: Llama 3.1 / 3.2's JSON calls, `{"name": ..., "parameters": {...}}`, at the
  start of the output (after `<|python_tag|>` if the template keeps it), one or more
  separated by `;`; an output that starts otherwise is all content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

#: The keys a call's arguments go under, in the formats read here.
ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = " \t\r\n"


@dataclass(frozen=True)
class CallText:
    """One call as far as the text goes: its name, and the text of its arguments so far
    (None: not started; complete or cut off, it is the model's own text)."""

    name: str
    arguments: str | None


@dataclass(frozen=True)
class Parsed:
    """What a text holds: its content (None when there is none) and its calls."""

    content: str | None
    calls: list[CallText]


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The end of the JSON string opening at text[i]; None if the text stops inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i]; None if the text stops inside it (a
    number or literal that reaches the end of the text may go on)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _SPACE:
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int) -> tuple[CallText | None, int | None]:
    """The call object `{"name": ..., "arguments" | "parameters": ...}` at text[i] (spaces
    first are skipped): (the call, or None if its name is not known yet or it is no such
    object; the end of the object, or None if the text stops inside it). A whole object
    without arguments has `{}`."""
    i = _skip_space(text, i)
    if i >= len(text) or text[i] != "{":
        return None, (None if i >= len(text) else i)
    name: str | None = None
    arguments: str | None = None
    j = i + 1
    while True:
        j = _skip_space(text, j)
        if j >= len(text):
            break
        if text[j] == "}":
            if name is None:
                return None, j + 1
            return CallText(name, "{}" if arguments is None else arguments), j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            return None, j  # not JSON we read: no call
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = _skip_space(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            return None, j
        j = _skip_space(text, j + 1)
        if j >= len(text):
            if key in ARGUMENT_KEYS:
                arguments = ""
            break
        end = value_end(text, j)
        if key == "name" and text[j] == '"':
            if end is None:
                break
            name = json.loads(text[j:end])
        elif key in ARGUMENT_KEYS and arguments is None:
            arguments = text[j:end] if end is not None else text[j:]
        if end is None:
            break
        j = end
    return (None if name is None else CallText(name, arguments)), None


def hermes(text: str) -> Parsed:
    """Hermes' `<tool_call>` blocks (the closing tag may be missing at the end). A block that
    holds no call object stays in the content, as does the text around the calls."""
    opener, closer = "<tool_call>", "</tool_call>"
    calls: list[CallText] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        call, end = scan_call(text, start + len(opener))
        if call is None and end is not None:  # a whole block that is no call: content
            close = text.find(closer, end)
            kept.append(text[pos : len(text) if close < 0 else close + len(closer)])
            pos = len(text) if close < 0 else close + len(closer)
            continue
        kept.append(text[pos:start])
        if call is not None:
            calls.append(call)
        if end is None:  # the text stops inside the call
            pos = len(text)
            break
        close = text.find(closer, end)
        pos = len(text) if close < 0 else close + len(closer)
    kept.append(text[pos:])
    content = "".join(kept)  # (not stripped: streamed content is a prefix of it)
    return Parsed(content if content.strip() else None, calls)


def hermes_content_prefix(text: str) -> str:
    """The part of a growing text that is surely content under `hermes`: before the first
    call opener and before a tail that may be the start of one."""
    opener = "<tool_call>"
    at = text.find(opener)
    if at >= 0:
        return text[:at]
    for k in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:k]):
            return text[:-k]
    return text


_PYTHON_TAG = "<|python_tag|>"


def _llama3_start(text: str) -> int | None:
    """Where Llama 3's calls start (the first `{`), None if the output is not calls, or -1
    while it cannot be told yet."""
    i = _skip_space(text, 0)
    rest = text[i:]
    if rest.startswith(_PYTHON_TAG):
        i = _skip_space(text, i + len(_PYTHON_TAG))
        rest = text[i:]
    elif _PYTHON_TAG.startswith(rest):
        return -1  # nothing yet, or a tag under way
    if not rest:
        return -1
    return i if rest[0] == "{" else None


def llama3_json(text: str) -> Parsed:
    """Llama 3's JSON calls at the start of the output, separated by `;`."""
    start = _llama3_start(text)
    if start is None or start < 0:
        return Parsed(text if text.strip() else None, [])
    calls: list[CallText] = []
    i = start
    while True:
        call, end = scan_call(text, i)
        if call is not None:
            calls.append(call)
        if call is None and not calls:
            return Parsed(text if text.strip() else None, [])
        if end is None:
            break
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ";":
            i = _skip_space(text, i + 1)
        if i >= len(text) or text[i] != "{":
            break
    return Parsed(None, calls)


def llama3_content_prefix(text: str) -> str:
    """Surely content under `llama3_json`: all of an output that does not start with a call,
    nothing of one that does or may."""
    return text if _llama3_start(text) is None else ""


@dataclass(frozen=True)
class Parser:
    """A call format: the text -> (content, calls), and the surely-content prefix of a
    growing text."""

    parse: Callable[[str], Parsed]
    content_prefix: Callable[[str], str]


#: --tool-call-parser choices.
PARSERS: dict[str, Parser] = {
    "hermes": Parser(hermes, hermes_content_prefix),
    "llama3_json": Parser(llama3_json, llama3_content_prefix),
}


def json_array_calls(text: str) -> list[CallText]:
    """The calls of `tool_choice: required`'s output, a JSON array of `{"name",
    "parameters"}` objects (vLLM's form), as far as the text goes."""
    i = _skip_space(text, 0)
    if i >= len(text) or text[i] != "[":
        return []
    calls: list[CallText] = []
    i += 1
    while True:
        call, end = scan_call(text, i)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        i = _skip_space(text, end)
        if i >= len(text) or text[i] != ",":
            return calls
        i += 1
