"""The offline API, as in vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from pagedserve.config import EngineArgs
from pagedserve.engine.beam_search import BeamSearch
from pagedserve.engine.input_processor import render_chat
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.entrypoints.score_utils import pair_scores, score_pairs, score_prompts
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import (BeamSearchOutput, ClassificationRequestOutput,
                                EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                                ScoringRequestOutput)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(args)
        llm._counter = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between benchmark runs). False while requests hold blocks."""
        return self.llm_engine.kv_cache_manager.block_pool.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts. Invalid input raises
        InvalidRequestError (a ValueError) before anything runs. A request the engine failed (a step raised while
        it ran) comes back finished with `error` set and finish_reason "error"; the others are unaffected."""
        inputs = self._normalize_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"got {len(params)} sampling params for {len(inputs)} prompts.")
        if priority is not None and len(priority) != len(inputs):
            raise ValueError(f"got {len(priority)} priorities for {len(inputs)} prompts.")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(inputs)
        if len(loras) != len(inputs):
            raise ValueError(f"got {len(loras)} lora requests for {len(inputs)} prompts.")
        ids = []
        try:
            for i, ((prompt, cache_salt), p) in enumerate(zip(inputs, params)):
                request_id = str(next(self._counter))
                p = _with_kind(p, RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0,
                                            cache_salt=cache_salt, lora_request=loras[i])
                ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    # ------------------------------------------------------------------ pooling models (runner="pooling")
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooler's raw output per prompt (outputs.data, a float32 tensor), in prompt order; pooling_params for
        every prompt or one per prompt (vLLM's). Invalid input raises InvalidRequestError (a ValueError) before
        anything runs; a generative engine refuses."""
        normalized = self._normalize_prompts(prompts, None)
        per_prompt = list(pooling_params) if isinstance(pooling_params, Sequence) \
            else [pooling_params or PoolingParams()] * len(normalized)
        if len(per_prompt) != len(normalized):
            raise InvalidRequestError(f"pooling_params: {len(per_prompt)} for {len(normalized)} prompts.",
                                      param="pooling_params")
        if pooling_task is not None:
            per_prompt = [dataclasses.replace(p, task=pooling_task) for p in per_prompt]
        ids = []
        try:
            for (prompt, cache_salt), params in zip(normalized, per_prompt):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
                ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (.outputs.embedding), normalised as the model's config says."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed",
                                     truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (.outputs.probs) from a sequence classification model."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def score(self, data_1: str | list[str], data_2: str | list[str], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The relevance of each (data_1, data_2) pair (one data_1 against every data_2, or pairwise): a
        cross-encoder reads the pair as one prompt; an embedding model gives the cosine similarity of the two
        embeddings."""
        pairs = score_pairs(data_1, data_2)
        params = dataclasses.replace(pooling_params or PoolingParams(), truncate_prompt_tokens=truncate_prompt_tokens)
        pooler = self.llm_engine.config.pooler
        prompts, per_prompt, task = score_prompts(self.get_tokenizer(), pairs,
                                                  pooler.task if pooler is not None else "score", params)
        outs = self.encode(prompts, per_prompt, use_tqdm)
        if task == "score":
            return [ScoringRequestOutput.from_base(o) for o in outs]
        by_text = dict(zip(prompts, outs))
        return [ScoringRequestOutput.from_base(PoolingRequestOutput(
                    f"{by_text[a].request_id}+{by_text[b].request_id}", PoolingOutput(torch.tensor([score])),
                    by_text[a].prompt_token_ids + by_text[b].prompt_token_ids))
                for (a, b), score in zip(pairs, pair_scores(pairs, prompts, outs, task))]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [render_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                               chat_template=chat_template) for conversation in conversations or [[]]]
        # the template already holds the special tokens
        token_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompt_token_ids=token_ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Deterministic beam search, as in vLLM (engine/beam_search.py): each step's live beams run as one
        batch of one-token requests that share their parents' KV blocks through the prefix cache."""
        engine = self.llm_engine
        engine.input_processor.check_beam_width(params.beam_width)
        search = BeamSearch([engine.tokenize(p) if not isinstance(p, dict) else list(p["prompt_token_ids"])
                             for p in ([prompts] if isinstance(prompts, str) else prompts)],
                            params, engine.model_config.eos_token_ids, engine.model_config.vocab_size)
        while live := search.live_prompts():
            search.advance(self.generate(prompt_token_ids=live, sampling_params=search.step_params, use_tqdm=False))
        return search.results(self.get_tokenizer())

    @staticmethod
    def _normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | list[int], str | None]]:
        """-> [(prompt text or token ids, cache_salt)]. Dicts follow vLLM's TextPrompt / TokensPrompt."""
        if prompt_token_ids is not None:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            return [(list(ids), None) for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("either prompts or prompt_token_ids is required.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out = []
        for p in prompts:
            if not isinstance(p, dict):
                out.append((p, None))
            elif "prompt_token_ids" in p:
                out.append((list(p["prompt_token_ids"]), p.get("cache_salt")))
            elif "prompt" in p:
                out.append((p["prompt"], p.get("cache_salt")))
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        return out

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        t0 = time.perf_counter()
        num_in = num_out = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if bar is not None:
                        num_in += len(output.prompt_token_ids)
                        num_out += sum(len(c.token_ids) for c in output.outputs) \
                            if isinstance(output, RequestOutput) else 0
                        elapsed = time.perf_counter() - t0
                        bar.set_postfix_str(f"est. speed input: {num_in / elapsed:.1f} toks/s, "
                                            f"output: {num_out / elapsed:.1f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in request_ids if i in results]


def _with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    if params.output_kind == kind:
        return params
    return dataclasses.replace(params, output_kind=kind)
