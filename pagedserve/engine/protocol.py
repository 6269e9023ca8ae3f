"""EngineClient: what the server may ask of the engine, and nothing else.

The OpenAI server depends on this protocol (implemented by AsyncLLM), never on engine internals: it reads the
frozen EngineConfig, validates through the engine's InputProcessor, submits and aborts requests, asks for
health, and registers stat loggers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Protocol

from pagedserve.config import EngineConfig, KVCacheConfig
from pagedserve.engine.events import EngineEventRecorder
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.request_stream import RequestStream
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics.loggers import StatLoggerBase
from pagedserve.metrics.server_profile import ServerProfile
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineHealth:
    healthy: bool
    status: str  # ok | starting | draining | dead | failing (failed steps in a row) | stalled (a step too long)
    message: str = ""


class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def kv_cache_config(self) -> KVCacheConfig: ...  # the KV blocks the engine allocated

    @property
    def tokenizer(self) -> Any: ...

    @property
    def input_processor(self) -> InputProcessor: ...

    @property
    def events(self) -> EngineEventRecorder: ...  # the step-event stream (subscribe / ring), thread-safe parts only

    @property
    def accepting(self) -> bool: ...

    @property
    def profile(self) -> ServerProfile: ...  # where the server's time goes (pagedserve/metrics/server_profile.py)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt_param: str = "prompt", lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue; raises InvalidRequestError (400) or QueueFullError (429) before any work."""
        ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort_nowait(self, request_id: str | Iterable[str]) -> None: ...

    def health(self) -> EngineHealth: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...  # ValueError if the adapter does not fit

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None: ...

    def begin_drain(self) -> None: ...

    def fail_all(self, exc: BaseException) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
