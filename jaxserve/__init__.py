"""jaxserve: an LLM inference and serving engine on JAX/XLA."""

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
