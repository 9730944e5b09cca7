"""Phi-3 (and Phi-3.5 / Phi-4-mini): the Llama decoder, checkpoints already fused.

Its checkpoints hold qkv_proj and gate_up_proj as one tensor each ([q | k | v] and
[gate | up], our layout), so they load as they are. No biases. sliding_window, when set,
applies to every layer (transformers masks all of them with it). Rotary: longrope's
short/long factors and partial_rotary_factor are in rope.py.
"""

from __future__ import annotations

from streamer.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    partial_rotary = True
    fused_checkpoint = True

    def attention_biases(self) -> tuple[bool, bool]:
        return False, False

    def expected_weight_names(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if not (n == "lm_head.weight" and self.tie_word_embeddings)}
