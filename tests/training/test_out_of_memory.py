"""The paragraph a rank prints when its GPU runs out of memory (megatron_ds/training/out_of_memory.py).

A real out-of-memory needs a GPU: tests/gpu (test_a_model_too_large_for_the_gpu_says_what_to_change) runs one end to
end through `entrypoint train`. Here: the words, from validated flags and torch's own exception type.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_ds.arguments import parse_args, validate
from megatron_ds.training.out_of_memory import GIB, levers, message

TORCH_SAYS = "CUDA out of memory. Tried to allocate 1.54 GiB. GPU 0 has a total capacity of 79.18 GiB"


def validated(tmp_path, world: int, *extra: str):
    """The settings of the flags `entrypoint train` hands a rank: parsed and validated for ``world`` ranks."""
    for name in ("corpus.bin", "corpus.idx"):
        (tmp_path / name).write_bytes(b"")
    args = parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "2048", "--train-iters", "10", "--lr", "1e-3", "--data-path", str(tmp_path / "corpus"),
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *extra], env={})
    return validate(args, world)


def memory(peak: float, reserved: float, allocated: float) -> dict[str, int]:
    return {"total": int(79.18 * GIB), "peak": int(peak * GIB), "reserved": int(reserved * GIB),
            "allocated": int(allocated * GIB)}


def test_the_message_names_the_gpu_torchs_line_and_every_lever_not_yet_used(tmp_path):
    settings = validated(tmp_path, 2, "--micro-batch-size", "16", "--global-batch-size", "64", "--zero-stage", "1")
    text = message(settings, torch.cuda.OutOfMemoryError(TORCH_SAYS + "\nmore lines"), 1, 1,
                   memory(75.4, 78.4, 75.4), "expandable_segments:True")
    assert text.startswith("rank 1 ran out of GPU memory (cuda:1, 79.2 GiB; PyTorch's peak 75.4 GiB) at micro "
                           "batch 16 x sequence 2048."), text
    assert f"PyTorch: {TORCH_SAYS}" in text and "more lines" not in text
    assert "fragmentation" not in text  # the allocator already grows its segments
    for lever in ("--micro-batch-size (now 16; the global batch 64 stays", "--checkpoint-activations",
                  "--zero-stage 2 (shards more of the training state over the 2 data-parallel ranks)",
                  "--tensor-model-parallel-size (now 1) or --pipeline-model-parallel-size (now 1)"):
        assert lever in text, (lever, text)


def test_levers_already_in_use_are_not_offered_again(tmp_path):
    # one data-parallel rank: ZeRO has nothing to shard over
    settings = validated(tmp_path, 1, "--micro-batch-size", "1", "--checkpoint-activations", "--zero-stage", "1")
    assert levers(settings) == ["a larger --tensor-model-parallel-size (now 1) or --pipeline-model-parallel-size "
                                "(now 1)"]


def test_fragmentation_is_named_where_the_allocator_does_not_grow_segments(tmp_path):
    settings = validated(tmp_path, 1, "--micro-batch-size", "16")
    err = torch.cuda.OutOfMemoryError(TORCH_SAYS)
    fragmented = message(settings, err, 0, 0, memory(71.7, 74.9, 71.7), "")
    assert "3.2 GiB were reserved but unused (fragmentation): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" \
        in fragmented, fragmented
    assert "fragmentation" not in message(settings, err, 0, 0, memory(71.7, 72.0, 71.7), "")


def test_the_even_pipeline_split_is_offered_where_the_default_loads_the_first_stages(tmp_path):
    settings = validated(tmp_path, 2, "--micro-batch-size", "1", "--checkpoint-activations", "--zero-stage", "1",
                         "--pipeline-model-parallel-size", "2")
    built = [3, 1]  # the built pipeline's split, as the trainer hands it on with the error
    assert levers(settings, built)[0] == ("--decoder-last-pipeline-num-layers 2 (equal layers per stage: the "
                                          "default 3 | 1 gives the stages before the output head's more)")
    assert "--decoder-last-pipeline-num-layers" not in " ".join(levers(settings, [2, 2]))
    assert "--decoder-last-pipeline-num-layers" not in " ".join(levers(settings))  # OOM before the pipeline was built
    # the user chose the split
    settings = replace(settings, layout=replace(settings.layout, decoder_last_pipeline_num_layers=1))
    assert "--decoder-last-pipeline-num-layers" not in " ".join(levers(settings, built))
