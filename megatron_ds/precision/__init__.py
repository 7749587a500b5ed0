"""The precision seam: fp32, bf16, fp16 today; FP8 (Transformer Engine, MS-AMP) slots in here."""

from megatron_ds.precision.policy import Precision, from_args

__all__ = ["Precision", "from_args"]
