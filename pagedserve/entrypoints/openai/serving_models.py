"""The models the server answers to (vLLM's OpenAIServingModels): the base model under its served names, and the LoRA
adapters given by --lora-modules or loaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter:
with --enable-lora and PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind
the API key like every route). A request's `model` picks the adapter; /v1/models lists each with the base as parent.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedserve import envs
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.protocol import ModelCard
from pagedserve.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """--lora-modules entries, as vLLM: `name=path`, or JSON {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise ValueError(f"--lora-modules JSON needs 'name' and 'path': {text!r}")
        return LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path (or JSON), got {text!r}")
    return LoRAModulePath(name, path)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingModels:
    def __init__(self, engine_client: EngineClient, base_model_names: list[str],
                 static_lora_modules: list[LoRAModulePath] = ()) -> None:
        self.engine_client = engine_client
        self.base_model_names = base_model_names  # the first is the one responses carry
        self.static_lora_modules = list(static_lora_modules)
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: an id names one adapter directory for the engine's life
        self._lock = asyncio.Lock()

    @property
    def enable_lora(self) -> bool:
        return self.engine_client.config.lora is not None

    async def init_static_loras(self) -> None:
        """--lora-modules, at start-up: a bad adapter stops the server before it serves."""
        for module in self.static_lora_modules:
            await self.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path))

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model; 404 for anything else."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def lora_cards(self, created: int, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, created=created, root=lora.lora_path, parent=self.base_model_names[0],
                          max_model_len=max_model_len) for name, lora in self.lora_requests.items()]

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> LoRARequest:
        if not self.enable_lora:
            raise OpenAIError(400, "LoRA adapters need a server started with --enable-lora.", param="lora_name")
        async with self._lock:
            if req.lora_name in self.lora_requests or req.lora_name in self.base_model_names:
                raise OpenAIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.",
                                  param="lora_name", code="lora_already_loaded")
            try:
                lora = LoRARequest(req.lora_name, next(self._ids), req.lora_path)
                await self.engine_client.add_lora(lora)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="lora_path") from exc
            self.lora_requests[req.lora_name] = lora
            return lora

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> None:
        async with self._lock:
            lora = self.lora_requests.get(req.lora_name)
            if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
                raise OpenAIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                                  code="model_not_found")
            try:
                await self.engine_client.remove_lora(lora.lora_int_id)
            except ValueError as exc:
                raise OpenAIError(409, str(exc), param="lora_name", code="lora_in_use") from exc
            del self.lora_requests[req.lora_name]


def add_lora_routes(app: FastAPI, models: OpenAIServingModels, guarded) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (plain-text answers, as vLLM's), only where LoRA is
    enabled and runtime updates are allowed; `guarded` turns errors into OpenAI error bodies."""
    if not models.enable_lora or not envs.PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING:
        return

    async def load(req: LoadLoRAAdapterRequest):
        await models.load_lora_adapter(req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(req: UnloadLoRAAdapterRequest):
        await models.unload_lora_adapter(req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        return await guarded(load(req))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        return await guarded(unload(req))
