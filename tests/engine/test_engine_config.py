"""EngineArgs.create_engine_config(): the frozen config every part of the engine is built from, resolved once
before anything is loaded (no model weights are read here)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedserve.config import EngineArgs


def test_config_is_resolved_at_creation_and_frozen(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    config = EngineArgs(model=path, dtype="float32", kv_cache_dtype="bfloat16", max_model_len=128,
                        served_model_name="tiny", num_kv_blocks=32, enable_chunked_prefill=False,
                        max_num_batched_tokens=16, speculative_config={"method": "ngram",
                                                                       "num_speculative_tokens": 3}
                        ).create_engine_config()
    assert (config.model.path, config.model.served_model_name, config.model.tokenizer) == (path, "tiny", path)
    assert (config.model.dtype, config.cache.kv_cache_dtype, config.parallel.device) == ("float32", "bfloat16", "cpu")
    assert config.model.max_model_len == config.scheduler.max_model_len == 128
    assert config.scheduler.max_num_batched_tokens == 128  # without chunked prefill a prompt must fit one step
    assert config.scheduler.num_lookahead_tokens == 0  # prompt lookup writes no K/V of its own
    assert config.cache.num_kv_blocks == 32 and config.parallel.distributed_executor_backend == "uni"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.max_model_len = 64  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache = None  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config  # worker ranks receive it


def test_defaults_come_from_the_checkpoint(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    config = EngineArgs(model=path, dtype="float32").create_engine_config()
    assert config.model.max_model_len == config.model.max_position_embeddings
    assert config.model.served_model_name == path and not config.model.is_default_model
    assert config.cache.kv_cache_dtype == "float32"  # auto: the model's
    draft = EngineArgs(model=path, speculative_config={"model": path, "num_speculative_tokens": 2}
                       ).create_engine_config()
    assert draft.scheduler.num_lookahead_tokens == 2  # a draft model writes its proposals' K/V past the step


def test_max_model_len_beyond_the_model_is_refused(tiny_model_dir):
    args = EngineArgs(model=str(tiny_model_dir("llama")), max_model_len=10**7)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        args.create_engine_config()
