"""OasisKV: an LLM inference engine and OpenAI-compatible server (PyTorch + Triton)."""
from oasiskv.config import EngineConfig
from oasiskv.llm import LLM
from oasiskv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"
