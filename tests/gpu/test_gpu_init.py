"""On a GPU: initial weights drawn on the rank's GPU (parallel/layers.weights_drawn_on, as build_engine does) stay
on it (sliced there, parameters born there), the same for every build and every TP slice, from N(0, std), and not
the CPU's numbers (the training layout tests then start every layout from them)."""

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_weights_drawn_on_the_gpu_are_seeded_full_matrices():
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: run the gpu-marked tests on the GPU machine")
    from megatron_ds.model.config import GPTConfig
    from megatron_ds.model.gpt import GPTModel
    from megatron_ds.parallel.layers import seeded_normal, slice_chunks, weights_drawn_on

    gpu = torch.device("cuda", torch.cuda.current_device())
    draw = seeded_normal(0.02, "test", "gpu draw")
    with weights_drawn_on(gpu):
        first, second = draw((4096, 1024)), draw((4096, 1024))
    on_cpu = draw((4096, 1024))
    assert first.device == gpu and torch.equal(first, second)
    assert not torch.equal(first.cpu(), on_cpu)
    assert abs(first.std().item() - 0.02) < 2e-4 and abs(first.mean().item()) < 2e-4
    halves = [slice_chunks(first, [4096], 0, 2, rank) for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), first)  # TP=2's slices are TP=1's matrix

    config = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=64)
    with weights_drawn_on(gpu):
        models = [GPTModel(config), GPTModel(config)]
    drawn = {"qkv", "proj", "fc1", "fc2", "word_embeddings", "position_embeddings"}
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        assert torch.equal(a, b), name
        if name.endswith("weight") and any(part in name for part in drawn) or name.endswith("position_embeddings"):
            assert a.device == gpu, f"{name}: drawn on the GPU but moved to {a.device}"
