"""The pooling routes (vLLM's serving_embedding / serving_pooling / serving_score): /v1/embeddings, /pooling,
/score, /rerank. Each input is one engine request (PoolingParams), submitted together (all or nothing) and answered
once all are pooled; a client that goes away aborts them. A generative engine answers these routes with a 400, as
a pooling engine answers the generation routes (the InputProcessor's rule)."""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.errors import BadRequest
from pagedserve.entrypoints.openai.pooling_protocol import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                            PoolingData, PoolingRequest, PoolingResponse,
                                                            PoolingUsage, RerankDocument, RerankRequest,
                                                            RerankResponse, RerankResult, RerankUsage, ScoreData,
                                                            ScoreRequest, ScoreResponse, _PoolingFields)
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, new_request_id, run_unless_disconnected
from pagedserve.entrypoints.score_utils import pair_scores, score_pairs, score_prompts
from pagedserve.outputs import PoolingRequestOutput
from pagedserve.pooling_params import PoolingParams

_API_NAMES = {"embed": "Embeddings API", "score": "Score API", "rerank": "Rerank API", "pooling": "Pooling API"}


class OpenAIServingPooling(OpenAIServing):
    # ------------------------------------------------------------------------------------ routes
    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request | None = None) -> JSONResponse:
        self._check(req, "embed")
        params = PoolingParams(task="embed", dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        outs = await self._pool("embd", self._inputs(req.input), params, req, raw_request)
        data = [EmbeddingData(index=i, embedding=_encode(o, req.encoding_format)) for i, o in enumerate(outs)]
        return self._respond(EmbeddingResponse, "embd", data, outs)

    async def create_pooling(self, req: PoolingRequest, raw_request: Request | None = None) -> JSONResponse:
        """The model's own output per input: an embedding model's embedding, a classifier's probabilities."""
        self._check(req, "pooling")
        params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)
        outs = await self._pool("pool", self._inputs(req.input), params, req, raw_request)
        data = [PoolingData(index=i, data=_encode(o, req.encoding_format)) for i, o in enumerate(outs)]
        return self._respond(PoolingResponse, "pool", data, outs)

    async def create_score(self, req: ScoreRequest, raw_request: Request | None = None) -> JSONResponse:
        self._check(req, "score")
        scores, outs = await self._scores(score_pairs(req.text_1, req.text_2), req, raw_request)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return self._respond(ScoreResponse, "score", data, outs)

    async def create_rerank(self, req: RerankRequest, raw_request: Request | None = None) -> JSONResponse:
        """The documents by relevance to the query, best first (the best top_n; 0: all)."""
        self._check(req, "rerank")
        scores, outs = await self._scores(score_pairs(req.query, req.documents, "query", "documents"), req,
                                          raw_request)
        ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:req.top_n or None]
        results = [RerankResult(index=i, document=RerankDocument(text=req.documents[i]), relevance_score=scores[i])
                   for i in ranked]
        usage = RerankUsage(total_tokens=sum(len(o.prompt_token_ids) for o in outs))
        return JSONResponse(RerankResponse(id=new_request_id("rerank"), model=self.served_model_name, usage=usage,
                                           results=results).model_dump())

    # ------------------------------------------------------------------------------------ shared
    def _check(self, req: _PoolingFields, route: str) -> None:
        self.check_model(req.model)
        pooler = self.engine_client.config.pooler
        task = "score" if route == "rerank" else route
        if pooler is None:
            raise BadRequest(f"The model does not support {_API_NAMES[route]}: it is a generative model (serve a "
                             f"pooling model, or this one with --runner pooling).", param="model",
                             code="unsupported_task")
        if task != "pooling" and task not in pooler.supported_tasks:
            raise BadRequest(f"The model does not support {_API_NAMES[route]}; it supports "
                             f"{', '.join(pooler.supported_tasks)}.", param="model", code="unsupported_task")

    def _inputs(self, value: Any) -> list[str | list[int]]:
        """OpenAI's `input`: a string, strings, a token-id array or arrays -> one prompt each (the engine
        tokenizes text and checks ids)."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        return list(value)

    async def _scores(self, pairs: list[tuple[str, str]], req: _PoolingFields,
                      raw_request: Request | None) -> tuple[list[float], list[PoolingRequestOutput]]:
        prompts, params, task = score_prompts(self.tokenizer, pairs, self.engine_client.config.pooler.task,
                                              PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens))
        outs = await self._pool("score", prompts, params, req, raw_request)
        return pair_scores(pairs, prompts, outs, task), outs

    async def _pool(self, prefix: str, prompts: list, params: PoolingParams | list[PoolingParams], req: _PoolingFields,
                    raw_request: Request | None) -> list[PoolingRequestOutput]:
        limit = self.engine_client.config.limits.max_sequences_per_request
        if len(prompts) > limit:
            raise BadRequest(f"This request has {len(prompts)} inputs; the limit is {limit} per request "
                             f"(--max-sequences-per-request).", param="input", code="too_many_sequences")
        streams = await self.submit(new_request_id(prefix), prompts, params, req, prompt_param="input")
        outs = await run_unless_disconnected(raw_request, asyncio.gather(*(s.get() for s in streams)),
                                             lambda: self.abort_streams(streams))
        return list(outs)

    def _respond(self, response_cls: type, prefix: str, data: list, outs: list[PoolingRequestOutput]) -> JSONResponse:
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse(response_cls(id=new_request_id(prefix), created=int(time.time()),
                                         model=self.served_model_name, data=data,
                                         usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump())


def _encode(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI's client decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(out.outputs.data.numpy().astype("<f4").tobytes()).decode()
    return out.outputs.data.tolist()

