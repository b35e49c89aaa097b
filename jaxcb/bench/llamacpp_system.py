"""The llama.cpp system of the offline benchmark: `llama-server`, what a CPU user picks instead.

llama.cpp is never a jaxcb dependency: the system starts the `llama-server` binary given by
`--llamacpp-server` (built from the llama-cpp-python sdist, see docs/benchmarks.md) as a
subprocess on a GGUF file of the same weights:

    llama-server -m FILE -np N -c CTX -cb -t 2 -kvu -ctk T -ctv T --cache-ram 0

N parallel slots with continuous batching, a unified KV pool of CTX cells (room for the N
longest requests at once), the KV cache in the weights' precision (f32 for F32, bf16 for BF16,
llama.cpp's default f16 for a quantized file), no prompt cache. Each pass sends every request
at once over HTTP to its native `/completion` endpoint: token-id prompts (so no BOS is added
and every system sees the same ids), greedy (`temperature` 0, `top_k` 1), `n_predict` =
max_tokens, `ignore_eos` for fixed lengths, `cache_prompt` off, `return_tokens` on; the
response's `tokens` are the generated ids (with the end-of-turn token when it stopped there),
and `tokens_evaluated` is checked against the prompt's length.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from jaxcb.bench.base import BenchContext, PassResult, check_lengths, stop_process
from jaxcb.bench.serving_client import post_stream
from jaxcb.bench.workloads import BenchRequest

#: KV cache type per GGUF file type (gguf's LlamaFileType names, MOSTLY_ dropped), so the
#: cache keeps the weights' precision; llama.cpp's default (f16) for the others.
KV_TYPES = {"ALL_F32": "f32", "BF16": "bf16"}


def completion_payload(request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    """The /completion body of one greedy request."""
    return dict(
        prompt=list(request.prompt_token_ids),
        n_predict=request.max_tokens,
        temperature=0.0,
        top_k=1,
        ignore_eos=ignore_eos,
        cache_prompt=False,
        return_tokens=True,
        stream=False,
    )


def parse_completion(body: dict[str, Any], request: BenchRequest) -> list[int]:
    """The generated token ids of a /completion response; RuntimeError if the server saw a
    different prompt (a BOS added, a truncation) or answered with an error."""
    if "error" in body:
        raise RuntimeError(f"llama-server: {body['error']}")
    evaluated = body.get("tokens_evaluated")
    if evaluated is not None and evaluated != len(request.prompt_token_ids):
        raise RuntimeError(
            f"llama-server evaluated {evaluated} prompt tokens, {len(request.prompt_token_ids)} "
            "were sent (BOS added or prompt truncated?)"
        )
    if body.get("truncated"):
        raise RuntimeError("llama-server truncated a request: raise its context (-c)")
    return [int(t) for t in body["tokens"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_file_type(path: Path) -> str:
    """'F32', 'BF16', 'Q4_1', ... from the file's general.file_type (the gguf package)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return "unknown"
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


class LlamaCppServer:
    """A llama-server subprocess on a free port, its log in a temporary file."""

    READY_TIMEOUT_S = 300.0

    def __init__(self, binary: Path, args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "llama-server.log"
        self._log = self.log_path.open("w")
        self.cmd = [str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.failure(f"exited with {self.proc.returncode}"))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(self.failure(f"not ready after {self.READY_TIMEOUT_S:.0f}s"))

    def failure(self, what: str) -> str:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"llama-server {what}; the end of its log ({self.log_path}):\n{tail}"

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


async def complete_all(
    url: str, requests: list[BenchRequest], ignore_eos: bool
) -> list[dict[str, Any]]:
    """POST every request at once to `url` (/completion); the JSON bodies in request order."""

    async def one(request: BenchRequest) -> dict[str, Any]:
        body = b"".join(
            [c async for c in post_stream(url, completion_payload(request, ignore_eos))]
        )
        return json.loads(body)

    return list(await asyncio.gather(*(one(r) for r in requests)))


def server_args(ctx: BenchContext, gguf: Path, file_type: str) -> list[str]:
    """llama-server's flags for this workload (see the module docstring)."""
    n = min(ctx.llamacpp_parallel, len(ctx.workload.requests))
    lengths = sorted(len(r.prompt_token_ids) + r.max_tokens for r in ctx.workload.requests)
    cells = -(-sum(lengths[-n:]) // 256) * 256  # the n longest at once
    args = ["-m", str(gguf), "-np", str(n), "-c", str(cells), "-cb", "-kvu"]
    args += ["-t", str(ctx.llamacpp_threads), "--cache-ram", "0", "--no-webui"]
    if file_type in KV_TYPES:
        args += ["-ctk", KV_TYPES[file_type], "-ctv", KV_TYPES[file_type]]
    return args + list(ctx.llamacpp_extra_args)


class LlamaCppSystem:
    """llama-server on `ctx.llamacpp_gguf()`, every request of a pass sent at once."""

    name = "llama.cpp"

    def __init__(self, ctx: BenchContext) -> None:
        if ctx.llamacpp_server is None:
            raise ValueError("the llama.cpp system needs --llamacpp-server (llama-server's path)")
        self.log, self.workload = ctx.log, ctx.workload
        self.requests, self.ignore_eos = ctx.workload.requests, ctx.workload.ignore_eos
        self.gguf = ctx.llamacpp_gguf()
        self.file_type = gguf_file_type(self.gguf)
        self.tmp = tempfile.TemporaryDirectory(prefix="jaxcb-llamacpp-")
        args = server_args(ctx, self.gguf, self.file_type)
        start = time.perf_counter()
        self.server = LlamaCppServer(Path(ctx.llamacpp_server), args, Path(self.tmp.name))
        self.load_s = time.perf_counter() - start
        self.log(f"llama-server ({self.file_type}) ready: {' '.join(self.server.cmd)}")
        k = max(1, min(ctx.warmup_requests, len(self.requests)))
        start = time.perf_counter()
        self._serve(self.requests[:k])
        self.warmup_s = time.perf_counter() - start

    def _serve(self, requests: list[BenchRequest]) -> list[dict[str, Any]]:
        try:
            return asyncio.run(
                complete_all(self.server.url + "/completion", requests, self.ignore_eos)
            )
        except OSError as exc:
            raise RuntimeError(self.server.failure(f"failed a request ({exc})")) from exc

    def info(self) -> dict[str, Any]:
        return dict(
            gguf=str(self.gguf),
            file_type=self.file_type,
            command=self.server.cmd,
            load_seconds=self.load_s,
            warmup_seconds=self.warmup_s,
        )

    def run_pass(self) -> PassResult:
        start = time.perf_counter()
        bodies = self._serve(self.requests)
        wall = time.perf_counter() - start
        token_ids = [parse_completion(b, r) for b, r in zip(bodies, self.requests, strict=True)]
        check_lengths(self.name, token_ids, self.requests, self.workload.stop_token_ids)
        timings = [b.get("timings") or {} for b in bodies]
        extra = dict(
            prompt_tokens_cached=sum(t.get("cache_n", 0) for t in timings),
            server_prompt_ms=sum(t.get("prompt_ms", 0.0) for t in timings),
            server_predicted_ms=sum(t.get("predicted_ms", 0.0) for t in timings),
        )
        return PassResult(wall, token_ids, extra)

    def close(self) -> None:
        self.server.close()
        self.tmp.cleanup()
