"""CI: wait for a starting `scripts/serve.py` (its log names the URL), then send it one chat
completion; exit 0 only for a 200 with non-empty content.

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

STARTUP_TIMEOUT = 900.0  # seconds: compiling the default buckets on a slow 2-core machine


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


def main() -> None:
    log_path, pid = sys.argv[1], int(sys.argv[2])
    url = wait_for_url(log_path, pid)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            status, reply = answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        sys.exit(f"chat completion: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
    content = reply["choices"][0]["message"]["content"]
    print(f"chat completion: HTTP {status} in {time.monotonic() - start:.2f} s: {content!r}")
    if status != 200 or not content.strip():
        sys.exit("chat completion: no content")


if __name__ == "__main__":
    main()
