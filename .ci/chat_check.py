"""CI: wait for a starting `scripts/serve.py` (its log names the URL), then send it what a
newcomer's first clients send: a chat completion, the same streamed, one with a tool to call,
one with a JSON schema (response_format), and a plain completion. Exit 0 only if each is a 200
with the content asked for; each answer and its time are printed.

    python .ci/chat_check.py SERVE_LOG SERVER_PID
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT = 900.0  # seconds: compiling the default buckets on a slow 2-core machine
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}


def wait_for_url(log_path: str, pid: int) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        match = re.search(r"listening on: (http://\S+)", Path(log_path).read_text())
        if match:
            return match.group(1)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log_text = Path(log_path).read_text()
            sys.exit(f"the server exited before it was ready; its log:\n{log_text}")
        time.sleep(1.0)
    sys.exit(f"the server was not ready in {STARTUP_TIMEOUT:.0f} s")


def post(url: str, route: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.read()
    except urllib.error.HTTPError as exc:
        sys.exit(f"{route}: HTTP {exc.code}: {exc.read().decode(errors='replace')}")


def check(name: str, ok: bool, shown: Any, start: float) -> None:
    print(f"{name}: HTTP 200 in {time.monotonic() - start:.2f} s: {shown!r}")
    if not ok:
        sys.exit(f"{name}: not the answer asked for")


def main() -> None:
    log_path, pid = sys.argv[1], int(sys.argv[2])
    url = wait_for_url(log_path, pid)
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 32, "temperature": 0}

    start = time.monotonic()
    content = json.loads(post(url, "/v1/chat/completions", chat))["choices"][0]["message"]
    check("chat completion", bool((content["content"] or "").strip()), content["content"], start)

    start = time.monotonic()
    events = post(url, "/v1/chat/completions", {**chat, "stream": True}).decode().split("\n\n")
    chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    done = any(e.strip() == "data: [DONE]" for e in events)
    check(f"streamed chat ({len(chunks)} chunks)", bool(text.strip()) and done, text, start)

    start = time.monotonic()
    tool_chat = {
        **chat,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 256,  # room for the JSON to close (at max_tokens it would be cut)
    }
    message = json.loads(post(url, "/v1/chat/completions", tool_chat))["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    arguments = json.loads(calls[0]["function"]["arguments"]) if calls else {}
    check("tool call", bool(calls) and "city" in arguments, calls, start)

    start = time.monotonic()
    schema_chat = {
        **chat,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": CITY_SCHEMA},
        },
        "max_tokens": 256,  # room for the JSON to close (at max_tokens it would be cut)
    }
    content = json.loads(post(url, "/v1/chat/completions", schema_chat))["choices"][0]["message"]
    place = json.loads(content["content"])
    check("response_format json_schema", set(CITY_SCHEMA["required"]) <= set(place), place, start)

    start = time.monotonic()
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    text = json.loads(post(url, "/v1/completions", {**body, "temperature": 0}))["choices"][0]
    check("completion", bool(text["text"].strip()), text["text"], start)


if __name__ == "__main__":
    main()
