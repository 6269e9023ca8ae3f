"""What the engine hands back per request (shapes follow vLLM's RequestOutput)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the engine failed this request alone (e.g. a tokenizer error); finish_reason is "abort".
    error: str | None = None


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as in vLLM
    logprobs: list[float]  # of each generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


# ------------------------------------------------------------------------------------------ pooling (vLLM's shapes)
@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor, float32 on the CPU: the embedding or the class probabilities (None if it failed)


@dataclass
class PoolingRequestOutput:
    """What a pooling engine hands back for a request, once, when its prompt has run."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request alone (outputs.data is None)


class _VectorOutput:
    @classmethod
    def from_base(cls, output: PoolingOutput):
        return cls(_values(output))


@dataclass
class EmbeddingOutput(_VectorOutput):
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput(_VectorOutput):
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ScoringOutput":
        return cls(_values(output)[0] if output.data is not None else float("nan"))


def _values(output: PoolingOutput) -> list[float]:
    """The output's numbers (none when the engine failed the request: its `error` says why)."""
    return output.data.reshape(-1).tolist() if output.data is not None else []


class _TypedPoolingRequestOutput(PoolingRequestOutput):
    output_type: ClassVar[Any]

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        return cls(out.request_id, cls.output_type.from_base(out.outputs), out.prompt_token_ids, out.finished,
                   out.prompt, out.metrics, out.error)


@dataclass
class EmbeddingRequestOutput(_TypedPoolingRequestOutput):
    outputs: EmbeddingOutput  # type: ignore[assignment]
    output_type = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TypedPoolingRequestOutput):
    outputs: ClassificationOutput  # type: ignore[assignment]
    output_type = ClassificationOutput


@dataclass
class ScoringRequestOutput(_TypedPoolingRequestOutput):
    outputs: ScoringOutput  # type: ignore[assignment]
    output_type = ScoringOutput
