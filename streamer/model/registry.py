"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from streamer.errors import ModelLoadError
from streamer.model.llama import LlamaForCausalLM
from streamer.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architectures: list[str] | None, source: str) -> type[LlamaForCausalLM]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{source}: unsupported architecture {architectures!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )
