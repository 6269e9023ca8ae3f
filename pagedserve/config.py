"""Engine arguments (vLLM's names), the CLI flags generated from them, and the frozen, resolved EngineConfig
built from them once the model is loaded."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pagedserve.core.scheduler import SchedulerConfig


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
    linear_backend: str = "auto"  # auto | torch | onednn: the GEMM path of the linears (CPU)
    served_model_name: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    trace_file: str | None = None  # write the engine's step events as JSONL (pagedserve/engine/events.py)
    # ---- request limits (each refused with a clear error before any work is done)
    max_logprobs: int = 20  # vLLM's name: top-N logprobs a request may ask for (beam width <= half of it)
    max_sequences_per_request: int = 256  # prompts x n of one request
    max_stop_strings: int = 64  # stop strings per request
    max_stop_chars: int = 8192  # their total length

    def __post_init__(self) -> None:
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
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}.")
        if self.linear_backend not in ("auto", "torch", "onednn"):
            raise ValueError(f"linear_backend must be auto, torch or onednn, got {self.linear_backend!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        for name in ("max_logprobs", "max_sequences_per_request", "max_stop_strings", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}.")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Every field becomes --field-name (booleans get --x/--no-x), as in vLLM."""
        for f in dataclasses.fields(EngineArgs):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif f.name == "kv_cache_memory_bytes":
                parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest=f.name,
                                    type=_parse_bytes, default=None,
                                    help="KV cache size in bytes (suffixes K, M, G accepted)")
            else:
                parser.add_argument(flag, type=_field_type(f), default=f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


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


# ------------------------------------------------------------------------------------ resolved config
@dataclass(frozen=True)
class ModelInfo:
    """What the served model is, as the engine resolved it."""
    path: str  # local checkpoint directory
    served_model_name: str
    is_default_model: bool  # the embedded demo model
    architecture: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_cache_dtype: str  # resolved

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class ParallelConfig:
    device: str  # resolved: cpu | cuda
    num_threads: int | None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class RequestLimits:
    max_logprobs: int = 20
    max_sequences_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_chars: int = 8192

    @classmethod
    def from_args(cls, args: EngineArgs) -> "RequestLimits":
        return cls(args.max_logprobs, args.max_sequences_per_request, args.max_stop_strings, args.max_stop_chars)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine resolved at start-up, in one frozen object: the server and the input processor
    read this, never the engine's internals."""
    model: ModelInfo
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    limits: RequestLimits
    seed: int = 0
