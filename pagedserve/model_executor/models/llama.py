"""Llama (1-3, with llama3 rope scaling) and Mistral: the shared decoder as is; q/k/v bias where config.json's
attention_bias says so."""
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
