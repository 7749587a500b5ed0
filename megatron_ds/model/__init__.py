"""The GPT model in reading order: plain torch plus our tensor-parallel layers."""
