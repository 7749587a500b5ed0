"""The GPT model in reading order: plain torch plus our tensor-parallel layers.

    from megatron_ds.model import GPTConfig, GPTModel
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32))
"""

from megatron_ds.model.config import GPTConfig, ModelConfigError
from megatron_ds.model.gpt import (
                                   EmbeddingStage,
                                   FinalNorm,
                                   GPTModel,
                                   OutputHead,
                                   StageSpec,
                                   TransformerLayer,
                                   gpt_stage_specs,
                                   lm_loss,
                                   tied_head_forward,
)

__all__ = ["GPTConfig", "ModelConfigError", "GPTModel", "EmbeddingStage", "TransformerLayer", "FinalNorm",
           "OutputHead", "StageSpec", "gpt_stage_specs", "lm_loss", "tied_head_forward"]
