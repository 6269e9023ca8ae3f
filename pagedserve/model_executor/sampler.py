"""Turns one step's logits into next tokens for a batch of sequences (semantics follow vLLM V1).

Order: logprobs from the raw logits -> penalties -> logit_bias, allowed_token_ids -> banned tokens (min_tokens,
bad_words) -> greedy argmax | temperature, top-k, top-p,
min-p, inverse-CDF draw. Penalties and bans apply to greedy rows too.

Random rows sample by inverse CDF: one uniform u per row, the token is the first whose cumulative probability
exceeds u * (row total), an exact draw from p. A seeded row's uniform comes from its own generator only, so its
tokens do not depend on the batch it runs in or its row index. (vLLM's exponential race, argmax(p / q) with
q ~ Exp(1), needs a full row of noise per step: on CPU drawing 49k exponentials per row cost ~1.6 ms a row,
50 ms per step at 32 rows; the CDF costs one cumulative sum.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.token_controls import (
    allowed_token_tensors,
    apply_token_controls,
    logit_bias_tensors,
)
from pagedserve.sampling_params import SamplingParams

# Temperatures below this are greedy; the same bound as SamplingParams.greedy.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per sequence that samples this step."""

    # The random rows' filters; all four None when every row is greedy (all_greedy), the common case, which reads
    # none of them: four small tensors built per step cost ~0.1 ms after a decode step has flushed the caches.
    temperature: torch.Tensor | None  # [N] float32, 0 => greedy row
    top_p: torch.Tensor | None  # [N] float32, 1.0 = off
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    min_p: torch.Tensor | None  # [N] float32, 0 = off
    all_greedy: bool
    # Fast paths: True when no random row uses the filter.
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator of a seeded random row
    # Penalties: all None when no row uses any penalty.
    presence_penalty: torch.Tensor | None = None  # [N] float32
    frequency_penalty: torch.Tensor | None = None  # [N] float32
    repetition_penalty: torch.Tensor | None = None  # [N] float32
    prompt_token_ids: list[Sequence[int]] | None = None  # per row, for the repetition penalty
    output_token_ids: list[Sequence[int]] | None = None  # per row, tokens generated so far
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> ids forced to -inf
    max_num_logprobs: int | None = None  # None: no logprobs; k >= 0: top-k plus the sampled token
    # Structured output: [N, >= V] float32 logit bias, 0 where a row may sample the token, -inf where not; or None.
    token_mask_bias: torch.Tensor | None = None
    # Token controls (token_controls.py): logit_bias as flat (rows, cols, values), allowed_token_ids as flat
    # (rows, cols) of the restricted rows; None when no row uses them.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        banned_token_ids: dict[int, list[int]],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Row i samples for params[i]; generators maps rows of seeded requests to their generators."""
        greedy = [p.greedy for p in params]
        random_params = [p for p, g in zip(params, greedy) if not g]
        needs_penalties = any(p.needs_penalties for p in params)

        def filter_tensor(name: str, neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
            """The random rows' filter `name`; greedy rows get the neutral value, so that they never defeat the fast
            paths. None (nothing built) when every row is greedy."""
            if not random_params:
                return None
            return torch.tensor([neutral if g else getattr(p, name) for p, g in zip(params, greedy)], dtype=dtype,
                                device=device)

        def penalty(values: list[float]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.float32, device=device) if needs_penalties else None

        return cls(
            temperature=filter_tensor("temperature", 0.0, torch.float32),
            top_p=filter_tensor("top_p", 1.0, torch.float32),
            top_k=filter_tensor("top_k", 0, torch.int64),
            min_p=filter_tensor("min_p", 0.0, torch.float32),
            all_greedy=not random_params,
            no_top_p=all(p.top_p >= 1.0 for p in random_params),
            no_top_k=all(p.top_k == 0 for p in random_params),
            no_min_p=all(p.min_p == 0.0 for p in random_params),
            # A greedy row never draws noise, so its generator must not advance.
            generators={row: g for row, g in generators.items() if not greedy[row]},
            presence_penalty=penalty([p.presence_penalty for p in params]),
            frequency_penalty=penalty([p.frequency_penalty for p in params]),
            repetition_penalty=penalty([p.repetition_penalty for p in params]),
            # References, not copies: prompts can be long, and the lists are only read during this step.
            prompt_token_ids=list(prompt_token_ids) if needs_penalties else None,
            output_token_ids=list(output_token_ids) if needs_penalties else None,
            banned_token_ids={row: list(ids) for row, ids in banned_token_ids.items() if ids},
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            logit_bias=logit_bias_tensors(params, device),
            allowed_token_ids=allowed_token_tensors(params, device),
        )


@dataclass
class LogprobsTensors:
    top_token_ids: torch.Tensor  # [N, k] int64
    top_logprobs: torch.Tensor  # [N, k] float32
    sampled_logprobs: torch.Tensor  # [N] float32
    sampled_ranks: torch.Tensor  # [N] int64, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """logits: [N, V]. default_generator feeds the unseeded random rows (None: torch's global RNG)."""
        logits, raw_logprobs = processed_logits(logits, metadata)
        sampled = _sample(logits, metadata, default_generator)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 logits after penalties, bans and structured-output masks - a copy whenever anything here or in the
    random rows' sampling changes them, never the caller's tensor written; the raw logprobs when any row asked for
    logprobs). Greedy rows with nothing to apply and no logprobs get the logits as they are, in the model's dtype."""
    # A float32 copy where the steps after this work in place (bf16 is too coarse for top-p/min-p cut-offs); greedy
    # rows with nothing to apply take the argmax of the logits as they are: bf16 converts to float32 exactly, so the
    # argmax is the same, without writing and reading a float32 copy (at 32 x 49152, 6 MB less per step).
    in_place = (not metadata.all_greedy or metadata.repetition_penalty is not None or bool(metadata.banned_token_ids)
                or metadata.token_mask_bias is not None or metadata.logit_bias is not None
                or metadata.allowed_token_ids is not None)
    if in_place or metadata.max_num_logprobs is not None or logits.dtype not in (torch.float32, torch.bfloat16):
        logits = logits.to(torch.float32, copy=in_place)
    raw_logprobs = None if metadata.max_num_logprobs is None else torch.log_softmax(logits, dim=-1)
    logits = apply_penalties(logits, metadata)
    logits = apply_token_controls(logits, metadata.logit_bias, metadata.allowed_token_ids)
    logits = apply_banned_tokens(logits, metadata.banned_token_ids)
    if metadata.token_mask_bias is not None:
        apply_token_mask_bias(logits, metadata.token_mask_bias)
    return logits, raw_logprobs


def greedy_ids_of(logits: torch.Tensor) -> torch.Tensor:
    """[N] each row's argmax (the first index on ties), of float32 or bfloat16 logits. On CPU the native kernel
    (per lane the largest value and its first index, then the lowest index holding the maximum) took 0.067 ms on
    [32, 49152] float32 or bf16 logits where max(dim) took 0.37-0.77 ms (AMD Zen 5); elsewhere max(dim), which
    gives argmax's indices and on CPU took 0.38-0.55x argmax's time."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2 \
            and logits.stride(1) == 1 and logits.size(1) > 0 and (kernels := cpu_kernels()) is not None:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _sample(
    logits: torch.Tensor, metadata: SamplingMetadata, default_generator: torch.Generator | None
) -> torch.Tensor:
    greedy_ids = greedy_ids_of(logits)
    if metadata.all_greedy:
        return greedy_ids
    random_ids = inverse_cdf_sample(sampling_probs(logits, metadata), metadata.generators, default_generator)
    return torch.where(metadata.temperature < SAMPLING_EPS, greedy_ids, random_ids)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[N, V] the distribution each random row samples from (temperature, top-k, top-p, then min-p; not
    renormalised after min-p). Greedy rows get softmax(logits): never used. Works in place on `logits`."""
    is_greedy = metadata.temperature < SAMPLING_EPS
    logits.div_(torch.where(is_greedy, 1.0, metadata.temperature).unsqueeze(1))
    logits = apply_top_k_top_p(
        logits,
        None if metadata.no_top_k else metadata.top_k,
        None if metadata.no_top_p else metadata.top_p,
    )
    probs = logits.softmax(dim=-1)
    if not metadata.no_min_p:
        probs = apply_min_p(probs, metadata.min_p)
    return probs


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32: how often each token occurs in each row's list."""
    rows = [torch.tensor(ids, dtype=torch.int64) for ids in token_ids]
    # Padding points at an extra column that is dropped afterwards.
    padded = pad_sequence(rows, batch_first=True, padding_value=vocab_size).to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence penalties over output tokens."""
    if metadata.repetition_penalty is None:
        return logits
    assert metadata.presence_penalty is not None and metadata.frequency_penalty is not None
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    vocab_size = logits.shape[-1]
    output_counts = token_counts(metadata.output_token_ids, vocab_size, logits.device)
    in_output = output_counts > 0
    seen = in_output | (token_counts(metadata.prompt_token_ids, vocab_size, logits.device) > 0)
    scale = torch.where(seen, metadata.repetition_penalty.unsqueeze(1), 1.0)
    # Dividing a positive logit and multiplying a negative one both make the token less likely for penalty > 1.
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits -= metadata.frequency_penalty.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalty.unsqueeze(1) * in_output
    return logits


def apply_token_mask_bias(logits: torch.Tensor, bias: torch.Tensor) -> None:
    """Structured output: logits += bias ([N, >= V] float32: 0 where a token is allowed, -inf where not; tokens past
    its width are never allowed). One whole-batch add, exact for allowed tokens."""
    width = min(logits.shape[1], bias.shape[1])
    if width < logits.shape[1]:
        logits[:, width:] = float("-inf")
    logits[:, :width].add_(bias[:, :width].to(logits.device))


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """Sets banned (row, token) entries to -inf in place, with one indexing op for the whole batch."""
    if not banned_token_ids:
        return logits
    rows = torch.cat([torch.full((len(ids),), row, dtype=torch.int64) for row, ids in banned_token_ids.items()])
    cols = torch.cat([torch.tensor(ids, dtype=torch.int64) for ids in banned_token_ids.values()])
    logits[rows.to(logits.device), cols.to(logits.device)] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets tokens outside each row's top-k, then outside its top-p nucleus, to -inf (in place).

    top_k 0 (or >= V) and top_p 1.0 leave a row alone. Tokens tied with the k-th logit are kept. The nucleus is
    the smallest most-likely-first set whose probability reaches top_p; the most likely token always stays.
    """
    if top_p is None:
        return logits if top_k is None else _apply_top_k_only(logits, top_k)
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
    # Rows with top_p = 1 are exempt: rounding can push the cumulative sum to 1 before the tail.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort of the vocabulary."""
    vocab_size = logits.shape[-1]
    off = (top_k <= 0) | (top_k >= vocab_size)
    k = top_k.masked_fill(off, 1)
    max_k = int(k.max())  # torch.topk needs a Python int: one host sync
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes (in place) tokens less likely than min_p times the row's top probability; not renormalised (the
    inverse-CDF draw scales its uniform by the row total)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def inverse_cdf_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """An exact sample from each row of (unnormalised, non-negative) probs: one uniform per row."""
    # float64 so that rounding in the running sum cannot hand mass to a zero-probability token
    cdf = probs.double().cumsum_(dim=-1)
    u = uniforms(probs.shape[0], generators, default_generator, probs.device)
    # first index whose cumulative sum exceeds u * total: its own probability is > 0
    threshold = (u * cdf[:, -1]).unsqueeze(1)
    ids = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return ids.clamp_max_(probs.shape[1] - 1)


def uniforms(num_rows: int, generators: dict[int, torch.Generator], default_generator: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    """[num_rows] float64 uniforms in [0, 1): a seeded row's from its own generator, the others' from the default."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        u.uniform_(generator=default_generator)
    for row, generator in generators.items():  # per seeded request, not per token
        u[row] = torch.rand((), dtype=torch.float64, generator=generator, device=device)
    return u


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Top num_logprobs tokens of each row plus the sampled token's logprob and rank (1 + number more likely)."""
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_token_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=ranks,
    )
