"""The vLLM system of the offline benchmark: vLLM's CPU build, in its own venv.

vLLM is never a jaxcb dependency: the system starts bench/vllm_runner.py with the python of
vLLM's venv (`--vllm-python`) as a subprocess and drives it one pass at a time over a line
protocol of JSON messages on its stdin/stdout; its stderr goes to a log file whose tail is
quoted when something fails.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from jaxcb.bench.base import BenchContext, PassResult, check_lengths, stop_process

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_environment(python: Path, binding: str) -> dict[str, str]:
    """The environment shared/BENCHMARKS.md runs vLLM's CPU build with: offline, 4 GiB of KV
    cache, and for the "tuned" binding OpenMP threads bound to cores 0-1 with Intel's
    OpenMP runtime (the venv's libiomp5.so) preloaded."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    env.pop("VIRTUAL_ENV", None)
    if binding == "tuned":
        # <venv>/bin/python is usually a symlink out of the venv: do not resolve it
        libiomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
        if not libiomp.is_file():
            raise RuntimeError(f"vllm binding 'tuned' needs {libiomp}: is this vLLM's venv?")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
        env["LD_PRELOAD"] = str(libiomp)
    elif binding != "default":
        raise ValueError(f"vllm binding must be 'tuned' or 'default', got {binding!r}")
    return env


class VLLMSystem:
    """vLLM's offline `LLM.generate` in its own venv (`--vllm-python`), run by
    bench/vllm_runner.py in a subprocess that loads the model once, then times one pass each
    time `run_pass` asks. Token-id prompts, `skip_tokenizer_init`, prefix cache reset per
    pass (or off, as the context says), max_model_len 2048 as BENCHMARKS.md runs it (more if
    the workload needs it)."""

    name = "vllm"
    READY_TIMEOUT_S = 900.0  # loading + torch.compile on a busy 2-core machine
    PASS_TIMEOUT_S = 3600.0

    def __init__(self, ctx: BenchContext) -> None:
        if ctx.vllm_python is None:
            raise ValueError("the vllm system needs --vllm-python (the python of vLLM's venv)")
        self.log, self.requests = ctx.log, ctx.workload.requests
        self.stops = ctx.workload.stops
        self.python, self.binding = Path(ctx.vllm_python), ctx.vllm_binding
        self.tmp = tempfile.TemporaryDirectory(prefix="jaxcb-vllm-")
        spec = Path(self.tmp.name) / "requests.json"
        spec.write_text(
            json.dumps(
                dict(
                    prompts=[r.prompt_token_ids for r in self.requests],
                    max_tokens=[r.max_tokens for r in self.requests],
                    warmup=ctx.warmup_requests,
                    ignore_eos=ctx.workload.ignore_eos,
                    stop_token_ids=list(self.stops),
                    prefix_caching=ctx.prefix_caching,
                )
            )
        )
        self.log_path = Path(self.tmp.name) / "vllm.log"
        self._log_file = self.log_path.open("w")
        config = json.loads((Path(ctx.model_dir) / "config.json").read_text())
        max_position = config.get("max_position_embeddings", 2048)
        max_model_len = max(ctx.workload.max_seq_len, min(2048, max_position))
        self.proc = subprocess.Popen(
            [str(self.python), str(VLLM_RUNNER), "--model", str(ctx.model_dir), "--dtype",
             ctx.dtype, "--requests", str(spec), "--max-model-len", str(max_model_len)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env=vllm_environment(self.python, self.binding),
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self._receive("ready", self.READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _receive(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(self._failure(f"no {event!r} after {timeout:.0f}s")) from None
            if line is None:
                raise RuntimeError(self._failure(f"runner exited before {event!r}"))
            message = json.loads(line)
            if message.get("event") == event:
                return message
            if message.get("event") == "error":
                raise RuntimeError(self._failure(message.get("message", "error")))

    def _failure(self, what: str) -> str:
        self._log_file.flush()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"vllm: {what}; the end of its log ({self.log_path}):\n{tail}"

    def info(self) -> dict[str, Any]:
        return dict(
            python=str(self.python),
            binding=self.binding,
            version=self.ready.get("version"),
            load_seconds=self.ready.get("load_s"),
            warmup_seconds=self.ready.get("warmup_s"),
        )

    def run_pass(self) -> PassResult:
        self.proc.stdin.write("pass\n")
        self.proc.stdin.flush()
        message = self._receive("pass", self.PASS_TIMEOUT_S)
        token_ids = message["token_ids"]
        check_lengths(self.name, token_ids, self.requests, self.stops)
        return PassResult(message["wall_s"], token_ids)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                stop_process(self.proc)
        self._log_file.close()
        self.tmp.cleanup()
