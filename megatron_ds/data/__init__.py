"""Megatron indexed datasets, tokenizers, preprocessing and GPT sample indices."""
