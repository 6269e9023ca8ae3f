"""pagedserve: a readable LLM inference and serving engine."""
import logging as _logging

from pagedserve.config import EngineArgs
from pagedserve.demo_model_path import default_model_path
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

_logger = _logging.getLogger("pagedserve")
if not _logger.handlers:  # start-up facts (model, KV cache size) are printed, as vLLM does
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it lazily so light imports stay light.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "default_model_path", "__version__"]
