"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from streamer.errors import ModelLoadError
from streamer.model.cohere import Cohere2ForCausalLM, CohereForCausalLM
from streamer.model.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from streamer.model.eagle_heads import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM
from streamer.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from streamer.model.glm4_moe import Glm4MoeForCausalLM
from streamer.model.gpt_oss import GptOssForCausalLM
from streamer.model.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from streamer.model.llama import LlamaForCausalLM, MistralForCausalLM
from streamer.model.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from streamer.model.olmo import Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM
from streamer.model.phi3 import Phi3ForCausalLM
from streamer.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from streamer.model.smollm3 import SmolLM3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # (draft heads only: load_model's draft_head)
    "LlamaForCausalLMEagle3": Eagle3LlamaForCausalLM,
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,
    "EagleLlamaForCausalLM": EagleLlamaForCausalLM,
}

HEADS: dict[str, type[LlamaForCausalLM]] = {"eagle3": Eagle3LlamaForCausalLM, "eagle": EagleLlamaForCausalLM}
"""speculative_config method -> the class of its heads (model/eagle_heads.py)."""


def model_class(architectures: list[str] | None, source: str) -> type[LlamaForCausalLM]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{source}: unsupported architecture {architectures!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )
