"""training/warmup.py: a stage's layer called ahead of the first step leaves the run as it was (same random
streams, no parameter gradient) and is asked for only where it pays."""

from __future__ import annotations

import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.training import warmup


def test_the_warm_up_changes_no_random_stream_and_keeps_no_gradient():
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
                       hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config).train()
    x = torch.randn(16, 2, 64)
    torch.manual_seed(7)
    expected = model.layers[0](x)
    torch.manual_seed(7)
    seconds = warmup.compile_stage_layers(model, (16, 2, 64), torch.device("cpu"))
    assert seconds is not None and seconds > 0
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.layers[0](x), expected)  # the same dropout masks as without the warm-up


def test_a_stage_without_transformer_layers_is_left_alone():
    assert warmup.compile_stage_layers(torch.nn.Linear(4, 4), (16, 2, 4), torch.device("cpu")) is None


def test_the_layer_input_is_the_sequence_shard_of_this_rank():
    shape = dict(seq_length=2048, micro_batch=4, hidden=5120)
    assert warmup.layer_input_shape(**shape, tp=2, sequence_parallel=True, ulysses=1) == (1024, 4, 5120)
    assert warmup.layer_input_shape(**shape, tp=2, sequence_parallel=False, ulysses=1) == (2048, 4, 5120)
    assert warmup.layer_input_shape(**shape, tp=1, sequence_parallel=False, ulysses=2) == (1024, 4, 5120)


def test_only_compiled_pipelines_without_stateful_fp8_warm_up():
    assert warmup.wanted(torch_compile=True, pipelined=True, fp8_engine=None)
    assert warmup.wanted(torch_compile=True, pipelined=True, fp8_engine="torchao")
    assert not warmup.wanted(torch_compile=True, pipelined=True, fp8_engine="te")
    assert not warmup.wanted(torch_compile=True, pipelined=False, fp8_engine=None)
    assert not warmup.wanted(torch_compile=False, pipelined=True, fp8_engine=None)
