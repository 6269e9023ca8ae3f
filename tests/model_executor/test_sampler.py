"""Sampler: greedy, temperature, top-k/top-p/min-p, bans, penalties, logprobs and the per-request seed guarantee."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.model_executor.sampler import (Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p,
                                               processed_logits)
from pagedserve.sampling_params import SamplingParams

sampler = Sampler()


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """These tensors are tiny: intra-op threads only add overhead (a lot of it on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metadata(
    params: list[SamplingParams],
    generators: dict[int, torch.Generator] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    banned_token_ids: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params,
        generators or {},
        prompt_token_ids or [[] for _ in params],
        output_token_ids or [[] for _ in params],
        banned_token_ids or {},
        "cpu",
    )


def sample_many(logits_row: list[float], params: SamplingParams, num: int = 20000, seed: int = 0) -> torch.Tensor:
    """Samples one distribution num times (one batch of identical rows); returns the token frequencies."""
    logits = torch.tensor([logits_row]).repeat(num, 1)
    out = sampler(logits, metadata([params] * num), torch.Generator().manual_seed(seed))
    return torch.bincount(out.sampled_token_ids, minlength=len(logits_row)).float() / num


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=seeded(0))
    out = sampler(logits, metadata([SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    # Models running in bf16: same argmax, float32 work inside.
    bf16 = logits.to(torch.bfloat16)
    out = sampler(bf16, metadata([SamplingParams(temperature=0.0, logprobs=2)] * 8))
    assert torch.equal(out.sampled_token_ids, bf16.float().argmax(dim=-1))
    assert out.logprobs is not None and out.logprobs.top_logprobs.dtype == torch.float32


def test_all_greedy_batches_build_no_filter_tensors() -> None:
    """An all-greedy step (the common case) builds none of the random rows' filters; one random row builds all four,
    with the greedy rows' filters neutral."""
    greedy = SamplingMetadata.build([SamplingParams(temperature=0)] * 3, {}, [], [], {}, "cpu")
    assert greedy.all_greedy and greedy.temperature is None and greedy.top_p is None and greedy.top_k is None \
        and greedy.min_p is None
    mixed = SamplingMetadata.build([SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=5)], {}, [],
                                   [], {}, "cpu")
    assert not mixed.all_greedy
    assert mixed.temperature.tolist() == [0.0, 0.5] and mixed.top_k.tolist() == [0, 5]
    assert mixed.top_p.tolist() == [1.0, 1.0] and mixed.min_p.tolist() == [0.0, 0.0]


def test_plain_greedy_bf16_logits_are_not_converted() -> None:
    """Greedy rows with nothing to apply take the argmax of bf16 logits as they are (no float32 copy written and
    read back), the same token as in float32, ties included; anything that works on the logits gets float32."""
    logits = (torch.randn(5, 49152, generator=seeded(7)) * 3).to(torch.bfloat16)
    logits[1, [100, 20000]] = logits[1].max() + 1  # a tie: the first wins
    greedy = metadata([SamplingParams(temperature=0.0)] * 5)
    assert processed_logits(logits, greedy)[0] is logits
    out = sampler(logits, greedy)
    assert torch.equal(out.sampled_token_ids, logits.float().max(dim=-1).indices)
    assert out.sampled_token_ids[1].item() == 100
    for params in (SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.8),
                   SamplingParams(temperature=0.0, repetition_penalty=1.2)):
        assert processed_logits(logits, metadata([params] * 5, output_token_ids=[[1]] * 5))[0].dtype == torch.float32


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    """Greedy rows pick the lowest index among equal maxima, as argmax does (HF's greedy search uses argmax)."""
    logits = torch.zeros(3, 49152)
    logits[0, [7, 30000]] = 5.0
    logits[1, [40000, 12, 49151]] = 2.0
    logits[2] = 1.0  # all tied
    out = sampler(logits, metadata([SamplingParams(temperature=0.0)] * 3))
    assert out.sampled_token_ids.tolist() == [7, 12, 0]


@pytest.mark.parametrize("params, banned", [
    (SamplingParams(temperature=0.7, top_k=5, top_p=0.8, repetition_penalty=1.5), {0: [3]}),
    (SamplingParams(temperature=0.0, repetition_penalty=1.5), {}),  # greedy with a penalty: copied
    (SamplingParams(temperature=0.0), {1: [4]}),  # greedy with a ban: copied
    (SamplingParams(temperature=0.0), {}),  # plain greedy: read in place, never written
])
def test_sampler_does_not_modify_input_logits(params, banned) -> None:
    logits = torch.randn(4, 30, generator=seeded(1))
    original = logits.clone()
    out = sampler(logits, metadata([params] * 4, output_token_ids=[[1, 2]] * 4, banned_token_ids=banned))
    assert torch.equal(logits, original)
    for row, ids in banned.items():  # the ban applied to the copy
        assert out.sampled_token_ids[row].item() not in ids


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies(temperature: float) -> None:
    logits = [2.0, 1.0, 0.0, -1.0]
    freq = sample_many(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_temperature_sharpens_and_flattens() -> None:
    logits = [2.0, 1.0, 0.0, -1.0]
    cold = sample_many(logits, SamplingParams(temperature=0.3))
    hot = sample_many(logits, SamplingParams(temperature=3.0))
    assert cold[0] > 0.9 and hot[0] < 0.45 and hot[3] > 0.1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(16, 100, generator=seeded(2)) * 3
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        for seed in range(5):
            out = sampler(logits, metadata([params] * 16), seeded(seed))
            assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_keeps_exactly_k() -> None:
    freq = sample_many([3.0, 2.5, 2.0, 1.0, 0.0], SamplingParams(top_k=2))
    assert (freq[:2] > 0.2).all() and (freq[2:] == 0).all()


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    freq = sample_many(logits, SamplingParams(top_p=0.7))  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert (freq[:2] > 0.3).all() and (freq[2:] == 0).all()
    freq = sample_many(logits, SamplingParams(top_p=0.85))  # 0.8 < 0.85 <= 0.95: tokens 0, 1, 2
    assert (freq[:3] > 0.1).all() and freq[3] == 0


def test_top_p_off_row_keeps_tail_in_top_p_batch() -> None:
    """float32 cumulative sums reach 1.0 before the tail; a row with top_p = 1 must still keep every token."""
    logits = torch.tensor([[20.0] + [0.0] * 9] * 2)
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert out[1].isfinite().tolist() == [True] + [False] * 9


def test_min_p_drops_low_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    freq = sample_many(logits, SamplingParams(min_p=0.2))  # threshold 0.1: token 3 goes
    assert (freq[:3] > 0.1).all() and freq[3] == 0
    # Survivors keep their relative odds.
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.015, rtol=0)


def test_banned_tokens_never_sampled() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]]).repeat(2000, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 1000
    banned = {row: [0, 2] for row in range(2000)}
    out = sampler(logits, metadata(params, banned_token_ids=banned), seeded(0)).sampled_token_ids
    assert set(out.tolist()) == {1, 3}
    assert (out[0::2] == 1).all()


def reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    expected = logits.clone()
    for row, p in enumerate(params):
        for token in set(prompts[row]) | set(outputs[row]):
            value = expected[row, token]
            expected[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return expected


def test_penalties_match_formulas() -> None:
    logits = torch.randn(4, 20, generator=seeded(3)) * 4
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.6, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        SamplingParams(),  # no penalty: untouched
    ]
    prompts = [[1, 2, 2, 19], [3, 4], [5, 5, 6, 0], [7, 8]]
    outputs = [[2, 9, 9, 9], [4, 4, 10, 11, 11, 11], [], [7, 7, 12]]
    meta = metadata(params, prompt_token_ids=prompts, output_token_ids=outputs)
    torch.testing.assert_close(
        apply_penalties(logits.clone(), meta), reference_penalties(logits, params, prompts, outputs)
    )
    assert metadata([SamplingParams()] * 4).repetition_penalty is None  # no penalty: nothing built


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0.0, presence_penalty=0.5)
    out = sampler(logits, metadata([greedy], output_token_ids=[[0]]))
    assert out.sampled_token_ids.tolist() == [1]


def test_logprobs_are_raw_and_ranked() -> None:
    logits = torch.randn(6, 40, generator=seeded(4)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.9, logprobs=1),
        SamplingParams(temperature=1.2, top_k=5, logprobs=0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(temperature=5.0, logprobs=3),
    ]
    meta = metadata(params, output_token_ids=[[0, 1]] * 6, banned_token_ids={0: [int(logits[0].argmax())]})
    assert meta.max_num_logprobs == 3
    out = sampler(logits, meta, seeded(0))
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, dim=-1)  # before penalties, bans and temperature
    top = raw.topk(3, dim=-1)
    torch.testing.assert_close(lp.top_logprobs, top.values)
    assert torch.equal(lp.top_token_ids, top.indices)
    sampled = out.sampled_token_ids
    torch.testing.assert_close(lp.sampled_logprobs, raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    for row in range(6):
        order = raw[row].argsort(descending=True).tolist()
        assert lp.sampled_ranks[row].item() == order.index(sampled[row].item()) + 1
    assert lp.sampled_ranks[0].item() == 2  # greedy row 0 had its best token banned


def test_logprobs_zero_gives_only_sampled() -> None:
    out = sampler(torch.randn(3, 10), metadata([SamplingParams(logprobs=0)] * 3))
    assert out.logprobs is not None and out.logprobs.top_token_ids.shape == (3, 0)
    assert out.logprobs.sampled_logprobs.shape == (3,)


VOCAB = 1000
STEPS = 20


def step_logits(step: int, row_seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=seeded(1000 * row_seed + step)) * 2


def run_seeded_request(
    params: SamplingParams, seed: int, batch_size: int, row: int, companion_seed: int
) -> list[int]:
    """The tokens a request seeded with `seed` samples over STEPS steps, at `row` of a batch whose other rows are
    a mix of seeded, unseeded, greedy, filtered and penalised requests."""
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.5, seed=1),
        SamplingParams(temperature=1.3, top_k=7, min_p=0.1),
        SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=2),
    ]
    params_by_row = [companions[(i + companion_seed) % 4] for i in range(batch_size)]
    params_by_row[row] = params
    generators = {row: seeded(seed)}
    for i, p in enumerate(params_by_row):
        if i != row and p.seed is not None and (i + companion_seed) % 3:  # some companions seeded, some not
            generators[i] = seeded(10_000 + i)
    default_generator = seeded(companion_seed)
    tokens = []
    for step in range(STEPS):
        row_seeds = [0 if i == row else i + 7 * companion_seed + 1 for i in range(batch_size)]
        logits = torch.stack([step_logits(step, row_seed) for row_seed in row_seeds])
        meta = metadata(params_by_row, generators, output_token_ids=[[1, 2, 3]] * batch_size)
        tokens.append(sampler(logits, meta, default_generator).sampled_token_ids[row].item())
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02, seed=42),
    ],
)
def test_seeded_row_independent_of_batch(params: SamplingParams) -> None:
    alone = run_seeded_request(params, seed=42, batch_size=1, row=0, companion_seed=0)
    assert len(set(alone)) > 5  # really random, not stuck on one token
    for batch_size, row, companion_seed in [(64, 37, 1), (64, 0, 2), (64, 63, 3), (5, 2, 0)]:
        assert run_seeded_request(params, 42, batch_size, row, companion_seed) == alone
    assert run_seeded_request(params, 43, 1, 0, 0) != alone


def test_seeded_row_uses_only_its_generator() -> None:
    """The row's draw is one uniform from its own generator, inverted through the CDF, as documented."""
    logits = step_logits(0, 0)
    out = sampler(logits.unsqueeze(0), metadata([SamplingParams(seed=5)], {0: seeded(5)}))
    u = torch.rand((), dtype=torch.float64, generator=seeded(5)).item()
    cdf = logits.softmax(-1).double().cumsum(0)
    expected = int((cdf <= u * cdf[-1].item()).sum())
    assert out.sampled_token_ids.item() == expected


def test_greedy_row_keeps_generator_untouched() -> None:
    meta = metadata([SamplingParams(temperature=0.0, seed=3), SamplingParams(seed=4)], {0: seeded(3), 1: seeded(4)})
    assert list(meta.generators) == [1]


def test_fast_path_flags() -> None:
    meta = metadata([SamplingParams(temperature=0.0, top_k=3, top_p=0.5), SamplingParams(min_p=0.1)])
    assert not meta.all_greedy and meta.no_top_k and meta.no_top_p and not meta.no_min_p
    assert metadata([SamplingParams(temperature=0.0)]).all_greedy


def allowed_tokens(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """A reference of the tokens a row may sample, with a small slack for float32 rounding at the cut-offs."""
    if p.greedy:
        return {int(logits.argmax())}
    scaled = (logits / torch.tensor(p.temperature, dtype=torch.float32)).double()
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < p.top_k < len(scaled):
        allowed &= scaled >= scaled.topk(p.top_k).values[-1]
    probs = torch.where(allowed, scaled.softmax(-1), 0.0)
    probs = probs / probs.sum()
    if p.top_p < 1.0:
        # In the nucleus iff the tokens strictly more likely hold less than top_p.
        mass_above = torch.stack([probs[probs > probs[i]].sum() for i in range(len(probs))])
        allowed &= mass_above < p.top_p + 1e-4
    if p.min_p > 0:
        kept = torch.where(allowed, probs, 0.0)
        allowed &= kept >= p.min_p * kept.max() * (1 - 1e-4)
    return set(torch.nonzero(allowed).flatten().tolist())


LOGIT_VALUES = [-8.0, -1.5, 0.0, 0.5, 1.0, 2.0, 6.0]  # a few distinct values: plenty of ties
row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.sampled_from([0, 1, 2, 5, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 1e-3]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(row_params, st.lists(st.sampled_from(LOGIT_VALUES), min_size=12, max_size=12)),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_sampled_tokens_within_allowed_set(rows: list[tuple[SamplingParams, list[float]]], seed: int) -> None:
    params = [p for p, _ in rows]
    logits = torch.tensor([values for _, values in rows])
    for draw in range(3):
        out = sampler(logits, metadata(params), seeded(seed + draw)).sampled_token_ids
        for row, p in enumerate(params):
            assert out[row].item() in allowed_tokens(logits[row], p)

