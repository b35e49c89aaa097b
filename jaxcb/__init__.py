"""jaxcb: continuous-batching LLM inference on JAX/XLA.

from jaxcb import LLM, SamplingParams
outs = LLM().generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from jaxcb.config import EngineConfig
from jaxcb.llm import LLM
from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
