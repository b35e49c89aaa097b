"""jaxcb: continuous-batching LLM inference on JAX/XLA.

from jaxcb import LLM, SamplingParams
outs = LLM().generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

`LLM` is imported on first use (it brings jax, the models and the kernels), so importing a
host-side module (`jaxcb.config`, `jaxcb.engine.sched.scheduler`, ...) never starts jax.
"""

from typing import TYPE_CHECKING, Any

from jaxcb.config import EngineConfig
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxcb.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from jaxcb.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxcb' has no attribute {name!r}")
