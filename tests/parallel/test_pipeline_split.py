"""Layers per pipeline stage: the default weighs the last stage's output head by its FLOPs; the flag sets it."""

from __future__ import annotations

import pytest

from megatron_ds.model.config import GPTConfig
from megatron_ds.parallel.pipeline_split import FLAG, even_split, spread, stage_layers
from megatron_ds.parallel.state import ParallelConfigError


def gpt(num_layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=50304,
                     seq_length=2048)


@pytest.mark.parametrize("config, head, splits", [
    # (pp=2, pp=4): GPT-1.3B's head is 1.75 layers, GPT-2.7B's 1.45, GPT-6.7B's 0.95 (even), GPT-13B's 0.77
    (gpt(24, 2048, 16), 1.754, ([13, 11], [6, 6, 7, 5])),
    (gpt(32, 2560, 32), 1.445, ([17, 15], [8, 8, 9, 7])),
    (gpt(32, 4096, 32), 0.945, ([16, 16], [8, 8, 8, 8])),
    (gpt(40, 5120, 40), 0.768, ([20, 20], [10, 10, 10, 10])),
])
def test_the_default_split_relieves_the_stage_with_the_head(config, head, splits):
    assert config.head_cost_in_layers() == pytest.approx(head, abs=1e-3)
    layer, logits = config.forward_flops_per_token()
    assert config.flops_per_token() == 3 * (config.num_layers * layer + logits)
    for pp, split in zip((2, 4), splits):
        assert stage_layers(config.num_layers, pp, head_layers=config.head_cost_in_layers()) == split
    assert stage_layers(24, 2) == [12, 12]  # no head cost: even
    assert stage_layers(7, 3) == [2, 2, 3]  # no even split: the extra layer on a later stage (less in flight)
    assert stage_layers(5, 1) == [5]


def test_the_flag_sets_the_last_stage_and_spreads_the_rest():
    assert stage_layers(24, 2, last=12, head_layers=1.75) == [12, 12]
    assert stage_layers(24, 4, last=3) == [7, 7, 7, 3]
    assert stage_layers(10, 4, last=3) == [2, 2, 3, 3]
    assert spread(7, 3) == [2, 2, 3] and even_split(24, 4) == [6] * 4 and even_split(3, 2) is None


@pytest.mark.parametrize("num_layers, pp, last, flag, text", [
    (1, 2, None, "--num-layers", "--num-layers 1 is fewer than --pipeline-model-parallel-size 2"),
    (4, 2, 4, FLAG, f"{FLAG} 4: the last stage needs at least one layer and the other 1 stage(s) at least one each"),
    (4, 2, 0, FLAG, "(so 1 to 3)"),
    (6, 4, 4, FLAG, "(so 1 to 3)"),
    (4, 1, 2, FLAG, f"{FLAG} 2 needs --pipeline-model-parallel-size > 1"),
])
def test_a_split_that_cannot_be_made_names_its_flag(num_layers, pp, last, flag, text):
    with pytest.raises(ParallelConfigError) as err:
        stage_layers(num_layers, pp, last=last)
    assert err.value.flag == flag and text in str(err.value)
