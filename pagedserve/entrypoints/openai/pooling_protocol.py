"""Pydantic models of the pooling routes (a pooling engine's API; vLLM's shapes): /v1/embeddings (OpenAI's),
/pooling, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank (Jina / Cohere). Same rules as protocol.py:
unknown fields refused, strict types."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field

from pagedserve.entrypoints.openai.protocol import Int, NonEmptyStr, TokenIds, _Request, _Response

# One input, or a batch: a string, a list of strings, one token-id array or a list of them (OpenAI's `input`)
Texts = Annotated[list[NonEmptyStr], Field(min_length=1)]
EmbeddingInput = Union[NonEmptyStr, Texts, TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]
TextOrTexts = Union[NonEmptyStr, Texts]


class _PoolingFields(_Request):
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[Int(ge=-1)] = Field(
        default=None, description="keep the last this many tokens of each input (-1: as many as max_model_len)")
    priority: Int() = 0
    cache_salt: Optional[NonEmptyStr] = None


class EmbeddingRequest(_PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int(ge=1)] = Field(default=None, description="Matryoshka models only")
    normalize: Optional[bool] = None


class PoolingRequest(_PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(_PoolingFields):
    text_1: TextOrTexts
    text_2: TextOrTexts


class RerankRequest(_PoolingFields):
    query: NonEmptyStr
    documents: Texts
    top_n: Int(ge=0) = Field(default=0, description="the best top_n documents (0: all)")


class PoolingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Response):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]  # a base64 string of little-endian float32 with encoding_format base64


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(_Response):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], str]


class PoolingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
