"""What every benchmarked system shares: the context it is built from, the result of one
pass, the interface it implements, and the check that it served every token it was asked for.

The systems themselves live in jaxcb_system.py, hf_systems.py and vllm_system.py; systems.py
registers them. This module imports none of them, so they can all import it.
"""

from __future__ import annotations

from collections.abc import Callable
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
    warmup_requests: int = 4  # untimed requests served before the timed passes
    hf_static_batch_size: int = 8
    hf_cb_options: dict[str, Any] = field(default_factory=dict)  # ContinuousBatchingConfig
    vllm_python: Path | None = None  # python of vLLM's own venv; None: no vllm system
    vllm_binding: str = "tuned"  # "tuned": OMP threads bound to 0-1 with Intel OpenMP
    record_trace: bool = False  # jaxcb keeps the step trace of its last pass
    _hf_model: Any = None

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


def check_lengths(name: str, token_ids: list[list[int]], requests: list[BenchRequest]) -> None:
    """Raise RuntimeError unless request i got exactly requests[i].max_tokens tokens."""
    bad = [
        (i, len(t), r.max_tokens)
        for i, (t, r) in enumerate(zip(token_ids, requests, strict=True))
        if len(t) != r.max_tokens
    ]
    if bad:
        raise RuntimeError(
            f"{name}: {len(bad)} requests did not return exactly max_tokens tokens "
            f"(index, got, wanted): {bad[:5]}; is EOS really ignored?"
        )
