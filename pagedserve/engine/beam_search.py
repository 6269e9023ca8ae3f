"""Beam search's bookkeeping, shared by the offline `LLM.beam_search` and the server's `use_beam_search`.

As in vLLM, every step each live beam is one ordinary engine request for one token with the top 2*beam_width
logprobs; the best beam_width continuations survive.  A beam's request repeats its parent's tokens, so the
prefix cache hands it the parent's full KV blocks (ref count +1, no copy); only the partly filled last block
is recomputed.  The caller runs the step requests (synchronously offline, through the async engine client on
the server) and feeds their outputs back:

    search = BeamSearch(prompts, params, eos_token_ids, vocab_size)
    while (live := search.live_prompts()):
        search.advance(run(live, search.step_params))
    results = search.results(tokenizer)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class BeamSearch:
    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 vocab_size: int) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1,
                                          logprobs=min(2 * params.beam_width, vocab_size), ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY)
        self.beams = [[BeamSearchSequence(list(p), [])] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._live: list[tuple[int, BeamSearchSequence]] = []

    def live_prompts(self) -> list[list[int]]:
        """The token ids of this step's requests (one per live beam); empty when the search is over."""
        self._live = [] if self.steps >= self.params.max_tokens else \
            [(i, b) for i, group in enumerate(self.beams) for b in group]
        return [b.tokens for _, b in self._live]

    def advance(self, outputs: list[RequestOutput]) -> None:
        """The finished one-token outputs of the requests `live_prompts()` returned, in its order."""
        width = self.params.beam_width
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.beams]
        for (i, beam), out in zip(self._live, outputs):
            for token, lp in out.outputs[0].logprobs[0].items():
                candidates[i].append(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [lp.logprob],
                                                        beam.cum_logprob + lp.logprob))
        for i, group in enumerate(candidates):
            group.sort(key=lambda b: b.cum_logprob, reverse=True)
            self.beams[i] = []
            for cand in group[:2 * width]:
                if not self.params.ignore_eos and cand.tokens[-1] in self.eos:
                    cand.finish_reason = "stop"
                    self.done[i].append(cand)
                elif len(self.beams[i]) < width:
                    self.beams[i].append(cand)
        self.steps += 1

    def results(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """Per prompt, the beam_width best of the finished and live beams, ranked by cum_logprob / len**penalty."""
        width = self.params.beam_width
        results = []
        for prompt_beams, finished in zip(self.beams, self.done):
            for b in prompt_beams:
                b.finish_reason = "length"
            pool = finished + prompt_beams
            pool.sort(key=lambda b: b.cum_logprob / max(len(b.logprobs), 1) ** self.params.length_penalty,
                      reverse=True)
            for b in pool[:width]:
                b.text = tokenizer.decode(b.tokens[len(b.tokens) - len(b.logprobs):], skip_special_tokens=True)
            results.append(BeamSearchOutput(pool[:width]))
        return results
