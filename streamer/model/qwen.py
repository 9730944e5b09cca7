"""Qwen2 and Qwen3: the Llama decoder with q/k/v bias (Qwen2) or per-head
q/k RMSNorm before rotary (Qwen3)."""

from streamer.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
