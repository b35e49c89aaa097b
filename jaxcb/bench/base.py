"""What every benchmarked system shares: the context it is built from, the result of one
pass, the interface it implements, and the check that it served every token it was asked for.

The systems themselves live in jaxcb_system.py, hf_systems.py, vllm_system.py and
llamacpp_system.py; systems.py registers them. This module imports none of them, so they can
all import it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jaxcb.bench.workloads import BenchRequest, Workload

Log = Callable[[str], None]


@dataclass
class BenchContext:
    """What every system is built from."""

    model_dir: Path
    workload: Workload
    dtype: str  # "float32" | "bfloat16", for every system alike
    log: Log = print
    jaxcb_config: str | Path | None = None  # YAML preset
    jaxcb_overrides: dict[str, Any] = field(default_factory=dict)  # flat config fields
    jaxcb_model: Path | None = None  # what jaxcb loads instead of model_dir (a GGUF file)
    warmup_requests: int = 4  # untimed requests served before the timed passes
    hf_static_batch_size: int = 8
    hf_cb_options: dict[str, Any] = field(default_factory=dict)  # ContinuousBatchingConfig
    vllm_python: Path | None = None  # python of vLLM's own venv; None: no vllm system
    vllm_binding: str = "tuned"  # "tuned": OMP threads bound to 0-1 with Intel OpenMP
    record_trace: bool = False  # jaxcb keeps the step trace of its last pass
    prefix_caching: bool = True  # vLLM's (jaxcb's is in jaxcb_overrides; llama.cpp's is off)
    llamacpp_server: Path | None = None  # llama-server binary; None: no llama.cpp system
    #: a GGUF path, or "f32" / "bf16" / "q4_1" for smollm2-135m's files (None: the dtype's)
    llamacpp_gguf_choice: str | None = None
    llamacpp_dir: Path | None = None  # llama.cpp sources: its converter writes missing GGUFs
    convert_python: str | None = None  # the python that runs the converter
    llamacpp_parallel: int = 128  # llama-server -np
    llamacpp_threads: int = 2  # llama-server -t
    llamacpp_extra_args: list[str] = field(default_factory=list)
    _hf_model: Any = None

    def llamacpp_gguf(self) -> Path:
        """The GGUF file llama.cpp runs (bench/smollm2.py's `resolve_gguf`)."""
        from jaxcb.bench.smollm2 import DTYPE_TO_GGUF, resolve_gguf

        return resolve_gguf(
            self.model_dir,
            self.llamacpp_gguf_choice or DTYPE_TO_GGUF[self.dtype],
            llamacpp_dir=self.llamacpp_dir,
            convert_python=self.convert_python,
        )

    def hf_model(self) -> Any:
        """The transformers model, loaded once and shared by the HF systems, EOS disabled."""
        if self._hf_model is None:
            import torch
            from transformers import AutoModelForCausalLM

            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).eval()
            # generate() fills every unset (None) field from the model's generation config;
            # clearing the EOS there is what makes "no EOS stop" stick.
            model.generation_config.eos_token_id = None
            self._hf_model = model
        return self._hf_model


@dataclass
class PassResult:
    wall_s: float  # the timed region
    token_ids: list[list[int]]  # per request, its max_tokens useful tokens
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific, JSON-able


class System(Protocol):
    name: str

    def info(self) -> dict[str, Any]: ...

    def run_pass(self) -> PassResult: ...

    def close(self) -> None: ...


def check_lengths(
    name: str,
    token_ids: list[list[int]],
    requests: list[BenchRequest],
    stop_token_ids: Collection[int] = (),
) -> None:
    """Raise RuntimeError unless request i got exactly requests[i].max_tokens tokens, or, with
    `stop_token_ids` (natural lengths), fewer that end at the first stop token."""
    stops = set(stop_token_ids)

    def ok(t: list[int], r: BenchRequest) -> bool:
        early = [i for i, x in enumerate(t) if x in stops]
        if len(t) == r.max_tokens:
            return not early or early == [len(t) - 1]
        return len(t) < r.max_tokens and early == [len(t) - 1]

    bad = [
        (i, len(t), r.max_tokens)
        for i, (t, r) in enumerate(zip(token_ids, requests, strict=True))
        if not ok(t, r)
    ]
    if bad:
        what = "stop at the end of the turn or" if stops else "return exactly"
        raise RuntimeError(
            f"{name}: {len(bad)} requests did not {what} max_tokens tokens "
            f"(index, got, wanted): {bad[:5]}; is EOS really {'honoured' if stops else 'ignored'}?"
        )


def cut_at_stop(tokens: list[int], stop_token_ids: Collection[int]) -> list[int]:
    """`tokens` up to and including the first stop token (what a system that pads finished
    rows, like transformers' `generate`, ran for)."""
    for i, t in enumerate(tokens):
        if t in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate `proc` if it still runs, then kill it if it has not exited in `timeout` s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
