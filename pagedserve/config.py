"""Engine arguments (vLLM's names), the CLI flags generated from them, and the frozen, resolved EngineConfig that
`EngineArgs.create_engine_config()` builds from them once, before anything is loaded: every part of the engine is
constructed from its part of it. The one thing known only after the model is loaded, how many KV blocks fit, is
the engine's KVCacheConfig, created once then."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.core.scheduler import SchedulerConfig
from pagedserve.json_args import parse_json_object
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.lora.config import LoRAConfig
from pagedserve.model_executor.model_config import ModelConfig


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3  # of available memory, when neither of the two above is given
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the budget
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # sha256 | builtin
    scheduling_policy: str = "fcfs"  # fcfs | priority
    quantization: str | None = None  # None | int8 (weight-only int8 linears, CPU)
    linear_backend: str = "auto"  # auto | torch | onednn | native: the GEMM path of the linears (CPU)
    attention_backend: str = "auto"  # auto | cpu | triton | torch (model_executor/attention/selector.py)
    served_model_name: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    num_threads: int | None = None  # torch intra-op threads per rank; None: all cores (split between the ranks)
    enforce_eager: bool = False  # no CUDA graphs for decode steps (docs/GPU.md); the CPU path never uses them
    # ---- pooling models (vLLM's --runner / --task; model_executor/pooler.py resolve_pooler_config)
    runner: str = "auto"  # auto | generate | pooling
    task: str = "auto"  # auto | generate | embed | classify | score
    # vLLM's --hf-overrides: config.json fields to replace, a dict or its JSON text (a causal LM served as a
    # classifier: architectures + classifier_from_token, models/adapters.py)
    hf_overrides: dict | str | None = None
    # ---- parallelism (docs/PARALLEL.md)
    tensor_parallel_size: int = 1  # -tp: heads, MLP channels and vocabulary split over this many ranks
    pipeline_parallel_size: int = 1  # -pp: layers split over this many stages
    distributed_executor_backend: str | None = None  # uni | mp | ray; None: uni for one rank, else mp
    cpu_bind: str | None = None  # cores per rank, "0-31|32-63" (or env PAGEDSERVE_CPU_OMP_THREADS_BIND)
    trace_file: str | None = None  # write the engine's step events as JSONL (pagedserve/engine/events.py)
    # ---- request limits (each refused with a clear error before any work is done)
    max_logprobs: int = 20  # vLLM's name: top-N logprobs a request may ask for (beam width <= half of it)
    max_sequences_per_request: int = 256  # prompts x n of one request
    max_stop_strings: int = 64  # stop strings per request
    max_stop_chars: int = 8192  # their total length
    max_stop_token_ids: int = 256  # stop_token_ids per request (each sampled token is looked up in them)
    # n x max_tokens x (logprobs + 1) of one request: each entry costs ~0.4 KB until the response is sent, so the
    # default bounds one request's logprobs at ~100 MiB (n=1, top-20 over 12k tokens still fits)
    max_logprob_entries: int = 1 << 18
    # structured output: the constraint's text (schema / regex / grammar / choices) in bytes, how long compiling
    # it may take (on a worker thread, off the engine and the event loop), and the compiled grammars' cache
    max_grammar_bytes: int = 256 << 10
    grammar_compile_timeout: float = 5.0  # seconds
    grammar_cache_bytes: int = 64 << 20
    # ---- speculative decoding: vLLM's --speculative-config, a dict or its JSON text (see SpeculativeConfig)
    speculative_config: dict | str | None = None
    # ---- KV beyond the pool: vLLM's --kv-transfer-config (see KVTransferConfig), or --kv-offloading-size GiB
    #      alone for a second tier in host memory
    kv_transfer_config: dict | str | None = None
    kv_offloading_size: float | None = None
    # ---- multi-LoRA (vLLM's flags; docs/SERVING.md#lora-adapters)
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters cached in host memory; None: max_loras

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer = KVTransferConfig.parse(self.kv_transfer_config, self.kv_offloading_size)
        if self.kv_transfer is not None and not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config needs prefix caching: blocks are found by their prefix hash.")
        if self.kv_transfer is not None and self.kv_transfer.is_shared and self.prefix_caching_hash_algo != "sha256":
            raise ValueError("a shared KV store needs prefix_caching_hash_algo sha256 (the builtin hash differs "
                             "between processes).")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.prefix_caching_hash_algo not in ("sha256", "builtin"):
            raise ValueError("prefix_caching_hash_algo must be 'sha256' or 'builtin'.")
        from pagedserve.model_executor.attention.selector import validate_attention_backend
        from pagedserve.model_executor.quantization.registry import validate_quantization

        validate_quantization(self.quantization)
        validate_attention_backend(self.attention_backend)
        if self.linear_backend not in ("auto", "torch", "onednn", "native"):
            raise ValueError(f"linear_backend must be auto, torch, onednn or native, got {self.linear_backend!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        for name in ("max_logprobs", "max_sequences_per_request", "max_stop_strings", "max_stop_chars",
                     "max_stop_token_ids", "max_logprob_entries", "max_grammar_bytes", "grammar_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}.")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1.")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be uni, mp or ray, "
                             f"got {self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size} needs 'mp' or 'ray'.")
        self.lora = LoRAConfig.create(self.max_loras, self.max_lora_rank, self.max_cpu_loras) \
            if self.enable_lora else None
        if self.lora is not None and (self.world_size > 1 or self.speculative is not None):
            raise ValueError("enable_lora works with one rank and without speculative decoding for now.")
        if self.kv_transfer is not None and self.world_size > 1:  # the connector moves rank 0's KV blocks only
            raise ValueError("kv_transfer_config / kv_offloading_size work with one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.world_size}.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def resolved_executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def create_engine_config(self) -> "EngineConfig":
        """Everything resolved, once: the checkpoint's config (downloaded if it is a hub id), the device, the dtypes,
        the token budget. Raises ValueError for a setting the model or the machine cannot serve."""
        from pagedserve.demo_model_path import default_model_path
        from pagedserve.model_executor.model_config import resolve_model_dir
        from pagedserve.model_executor.platform import resolve_device, resolve_dtype
        from pagedserve.model_executor.quantization.registry import CHECKPOINT_FORMATS, resolve_quantization

        model_dir = Path(default_model_path()) if self.model is None else resolve_model_dir(self.model, self.revision)
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        kv_dtype = dtype if self.kv_cache_dtype == "auto" else resolve_dtype(self.kv_cache_dtype, device)
        model = ModelConfig.from_dir(model_dir, dtype=dtype_name(dtype), max_model_len=self.max_model_len,
                                     served_model_name=self.served_model_name or self.model or "pagedserve-demo",
                                     tokenizer=self.tokenizer or str(model_dir), is_default_model=self.model is None,
                                     hf_overrides=parse_json_object(self.hf_overrides, "hf_overrides", None)
                                     if self.hf_overrides else None)
        quantization = resolve_quantization(self.quantization, model.quantization_config)
        if quantization in CHECKPOINT_FORMATS and self.tensor_parallel_size > 1:  # its tensors are not split yet
            raise ValueError(f"A {quantization} checkpoint runs with tensor_parallel_size=1 for now.")
        from pagedserve.model_executor.models.registry import is_encoder_only
        from pagedserve.model_executor.pooler import resolve_pooler_config

        pooler = resolve_pooler_config(model_dir, model.architecture, self.runner, self.task, model.hf_overrides)
        enable_prefix_caching = self.enable_prefix_caching
        if pooler is not None:
            if self.speculative is not None or self.pipeline_parallel_size > 1:
                raise ValueError("pooling models run without speculative_config and pipeline parallelism.")
            if self.lora is not None:
                raise ValueError("LoRA adapters are for generation: a pooling model runs without enable_lora.")
            # a cached prefix is not computed again: only the last token's hidden state is always there
            enable_prefix_caching = enable_prefix_caching and pooler.pooling_type == "LAST"
        chunked_prefill = self.enable_chunked_prefill
        if is_encoder_only(model.architecture):  # bidirectional: every token's state depends on the whole prompt
            if self.tensor_parallel_size > 1:
                raise ValueError("Encoder models (BERT, RoBERTa) run with tensor_parallel_size=1.")
            enable_prefix_caching = chunked_prefill = False
        budget = self.max_num_batched_tokens
        if not chunked_prefill and budget < model.max_model_len:
            logger.warning("Without chunked prefill a whole prompt must fit one step: raising "
                           "max_num_batched_tokens from %d to max_model_len=%d.", budget, model.max_model_len)
            budget = model.max_model_len
        spec = self.speculative
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget, max_model_len=model.max_model_len,
            enable_chunked_prefill=chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.scheduling_policy,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec is not None else 0,
            max_loras=self.lora.max_loras if self.lora is not None else 0)
        return EngineConfig(
            model=model,
            cache=CacheConfig(self.block_size, dtype_name(kv_dtype), enable_prefix_caching,
                              self.prefix_caching_hash_algo, self.num_kv_blocks, self.kv_cache_memory_bytes,
                              self.kv_cache_memory_fraction),
            scheduler=scheduler,
            parallel=ParallelConfig(device.type, self.num_threads, self.tensor_parallel_size,
                                    self.pipeline_parallel_size, self.resolved_executor_backend, self.cpu_bind),
            load=LoadConfig(self.linear_backend, quantization),
            limits=RequestLimits.from_args(self),
            seed=self.seed,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            speculative=spec,
            kv_transfer=self.kv_transfer,
            trace_file=self.trace_file,
            lora=self.lora,
            pooler=pooler)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Every field becomes --field-name (booleans get --x/--no-x), as in vLLM."""
        for f in dataclasses.fields(EngineArgs):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name in SHORT_FLAGS:
                parser.add_argument(flag, SHORT_FLAGS[f.name], type=int, default=f.default)
            elif f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif f.name == "speculative_config":
                parser.add_argument(flag, type=str, default=None,
                                    help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                                         '"prompt_lookup_max": 4}\' or \'{"model": PATH, "num_speculative_tokens": 3}\'')
            elif f.name == "hf_overrides":
                parser.add_argument(flag, type=str, default=None,
                                    help='JSON, e.g. \'{"architectures": ["Qwen3ForSequenceClassification"], '
                                         '"classifier_from_token": ["no", "yes"], '
                                         '"is_original_qwen3_reranker": true}\'')
            elif f.name == "kv_transfer_config":
                parser.add_argument(flag, type=str, default=None,
                                    help='JSON, e.g. \'{"kv_connector": "redis", "url": "redis://127.0.0.1:6379"}\' '
                                         '(kv_connector cpu | redis | directory; kv_role kv_both | kv_producer | '
                                         'kv_consumer; kv_buffer_size; path; save_policy evict | write_through)')
            elif f.name == "served_model_name":  # vLLM: several names; the first is the one responses carry
                parser.add_argument(flag, nargs="+", default=None,
                                    help="name(s) the API accepts as `model`; the first is reported")
            elif f.name == "kv_cache_memory_fraction":  # vLLM's --gpu-memory-utilization lands here (SERVING.md)
                parser.add_argument(flag, "--gpu-memory-utilization", dest=f.name, type=float, default=f.default)
            elif f.name == "kv_offloading_size":
                parser.add_argument(flag, type=float, default=None,
                                    help="GiB of host memory for a second KV tier (evicted blocks are kept there)")
            elif f.name == "kv_cache_memory_bytes":
                parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest=f.name,
                                    type=_parse_bytes, default=None,
                                    help="KV cache size in bytes (suffixes K, M, G accepted)")
            else:
                parser.add_argument(flag, type=_field_type(f), default=f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if isinstance(values.get("served_model_name"), list):  # aliases are the server's: the engine has the first
            values["served_model_name"] = values["served_model_name"][0]
        return cls(**values)


logger = logging.getLogger("pagedserve")

if TYPE_CHECKING:
    import torch

    from pagedserve.model_executor.pooler import PoolerConfig


def dtype_name(dtype: "torch.dtype") -> str:
    """torch.bfloat16 -> "bfloat16" (the configs hold names: picklable, JSON, and no torch import here)."""
    return str(dtype).removeprefix("torch.")


SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}  # as vLLM


def _field_type(f: dataclasses.Field):
    text = str(f.type)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's fields). `ngram`: prompt lookup, drafts copied from where the request's
    latest prompt_lookup_max..prompt_lookup_min tokens occurred before in its own prompt + output. `draft_model`:
    a smaller model with the same tokenizer proposes, with its own paged KV cache in the same engine.

    Policy (never much worse than no speculation): a request is given no drafts while it is constrained by a
    grammar, uses penalties or still has min_tokens to reach; none at all while `disable_by_batch_size` or more
    requests run (the step is compute-bound there, and verifying k tokens costs about k decode tokens); and each
    request's draft length follows its own acceptance rate alpha: the largest k (at most num_speculative_tokens)
    with alpha^k above the relative cost of a verified row (spec_decode/policy.py), so a request whose drafts
    keep failing stops drafting, and proposes only when a proposer finds a match (ngram) or every step (draft
    model)."""
    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_min: int = 5  # one given: the other takes its value
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (method draft_model)
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, value: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From vLLM's JSON/dict form; ValueError naming the field when something is off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_object(value, "speculative_config", {
            "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
            "disable_by_batch_size"})
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model' (or give 'model'), got "
                             f"{value.get('method')!r}.")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 32], got {k!r}.")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {n!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
        model = value.get("model")
        if method == "draft_model" and not model:
            raise ValueError("speculative_config.model (the draft model's path or name) is required for draft_model.")
        if method == "ngram" and model:
            raise ValueError("speculative_config.model is only for method draft_model.")
        disable = value.get("disable_by_batch_size", 8)
        if not isinstance(disable, int) or isinstance(disable, bool) or disable < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {disable!r}.")
        return cls(method, k, lo, hi, model, disable)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler reserves past each step's tokens: a draft model writes the K/V of its own proposals
        there; prompt lookup writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


# ------------------------------------------------------------------------------------ resolved config
@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, dtype and prefix caching, and how large it may be (the block count that fits is
    resolved after the model is loaded: KVCacheConfig)."""
    block_size: int
    kv_cache_dtype: str  # resolved: float32 | bfloat16 | float16
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    num_kv_blocks: int | None = None  # exactly this many blocks
    kv_cache_memory_bytes: int | None = None  # else as many blocks as fit these bytes
    kv_cache_memory_fraction: float = 0.3  # else this share of the memory available after loading the model


@dataclass(frozen=True)
class KVCacheConfig:
    """How many KV blocks the engine allocated (resolved once the model is loaded and the free memory is known)."""
    num_blocks: int
    block_size: int
    bytes_per_block: int  # one block in every layer's K and V, summed over the ranks that share a memory
    # a hybrid model's KV cache groups (core/kv_cache_groups.py): a block holds one group's layers, and a token of
    # full-attention context takes a block slot in every group
    num_kv_cache_groups: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens of context the cache holds with every group keeping all of it (a sliding group keeps less). A model
        without KV cache groups (an encoder) keeps no KV: the cache bounds no context (sys.maxsize)."""
        if not self.num_kv_cache_groups:
            return sys.maxsize
        return self.num_blocks // self.num_kv_cache_groups * self.block_size


@dataclass(frozen=True)
class ParallelConfig:
    device: str  # resolved: cpu | cuda
    num_threads: int | None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # resolved: uni | mp | ray
    cpu_bind: str | None = None  # cores per rank ("0-31|32-63"); None: PAGEDSERVE_CPU_OMP_THREADS_BIND or none

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoadConfig:
    """How the weights are run: the linears' GEMM path and weight quantization."""
    linear_backend: str = "auto"  # auto | torch | onednn | native
    quantization: str | None = None  # None | int8 | int4 | a checkpoint's format (registry.py), as resolved


@dataclass(frozen=True)
class RequestLimits:
    max_logprobs: int = 20
    max_sequences_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_chars: int = 8192
    max_stop_token_ids: int = 256
    max_logprob_entries: int = 1 << 18
    max_grammar_bytes: int = 256 << 10
    grammar_compile_timeout: float = 5.0
    grammar_cache_bytes: int = 64 << 20

    @classmethod
    def from_args(cls, args: EngineArgs) -> "RequestLimits":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class EngineConfig:
    """Everything resolved from the EngineArgs before anything is loaded, in one frozen (and picklable: worker
    ranks get it) object. Each part of the engine is built from its part; the server and the input processor read
    this (and the engine's KVCacheConfig), never the engine's internals."""
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    limits: RequestLimits
    load: LoadConfig = LoadConfig()
    seed: int = 0
    attention_backend: str = "auto"  # --attention-backend; each runner resolves "auto" for its device
    enforce_eager: bool = False  # no CUDA graphs
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    trace_file: str | None = None
    lora: LoRAConfig | None = None  # --enable-lora
    pooler: "PoolerConfig | None" = None  # a pooling engine's pooler (runner "pooling"); None: generation
