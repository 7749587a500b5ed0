"""What of the MS-AMP engine runs without MS-AMP: which Linears it leaves to LinearReplacer, and its refusal here.
(MS-AMP itself needs CUDA and its extensions: its names are checked against its sources in test_msamp_api.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.precision.fp8 import FP8Options, local_gemms
from megatron_ds.precision.fp8_msamp import MSAMPEngine, keep_high_precision

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
            attention_backend="sdpa", params_dtype=torch.bfloat16)


@pytest.mark.parametrize("untied", [False, True])
def test_linear_replacer_sees_only_the_transformer_layers_gemms(untied):
    model = GPTModel(GPTConfig(**BASE, untie_embeddings_and_output_weights=untied))
    chosen = local_gemms(model)
    marked = keep_high_precision(model, {id(m) for m in chosen.values()})
    # MS-AMP's LinearReplacer replaces every nn.Linear without use_fp32_linear: exactly our chosen GEMMs
    replaceable = {name for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and not getattr(m, "use_fp32_linear", False)}
    assert replaceable == set(chosen) and len(chosen) == 8
    assert marked == (["output_head.linear.local"] if untied else [])


def test_msamp_is_refused_here_naming_what_is_missing():
    assert importlib.util.find_spec("msamp") is None
    why = MSAMPEngine(FP8Options()).missing()
    assert why.startswith("MS-AMP is not installed (msamp is not importable)") and "MS-AMP image" in why
