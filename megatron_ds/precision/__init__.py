"""The precision seam: fp32, bf16, fp16, and FP8 beside bf16/fp16 through an engine (torchao, Transformer Engine,
MS-AMP: fp8.py) that swaps the transformer layers' local GEMMs."""

from megatron_ds.precision.policy import Precision, precision_from

__all__ = ["Precision", "precision_from"]
