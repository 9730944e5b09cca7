"""Qwen2 and Qwen3: the Llama decoder with q/k/v bias (Qwen2, always; no o_proj bias) or
per-head q/k RMSNorm before rotary (Qwen3, biases from attention_bias). Sliding layers come
from layer_types (the config builds them from use_sliding_window and max_window_layers)."""

from streamer.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
