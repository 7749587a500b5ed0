"""GPTModel at TP=2 (two real gloo processes) equals GPTModel at TP=1: loss, logits and gradients.

Cases cover GPT-2 style (learned positions, LayerNorm, GeLU, tied, biases) and LLaMA style (rope,
RMSNorm, SwiGLU, GQA with 2 kv heads, untied, no biases), with and without sequence parallelism,
activation checkpointing, and hidden dropout (same seed: the masks match by construction).
The model depends only on its arguments: inside the same TP=2 world, a model built without a group
is the whole TP=1 model, and only the group passed in slices it.
Tolerance: fp32, max |a - b| <= 1e-5 * max|b| + 1e-7 per tensor (relative ~1e-5).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ds.model.config import GPTConfig, ModelConfigError
from megatron_ds.model.gpt import GPTModel, TransformerLayer, gpt_stage_specs
from megatron_ds.parallel import state
from megatron_ds.parallel.layers import slice_chunks
from megatron_ds.parallel.testing import run_on_ranks

TP = 2
BATCH = 2
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=11)
GPT2 = dict(BASE)
LLAMA = dict(BASE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_key_value_heads=2,
             ffn_hidden_size=48, untie_embeddings_and_output_weights=True, add_bias_linear=False)
CASES = {
    "gpt2": GPT2,
    "gpt2_sp": dict(GPT2, sequence_parallel=True),
    "gpt2_dropout": dict(GPT2, hidden_dropout=0.2),
    "gpt2_dropout_sp": dict(GPT2, hidden_dropout=0.2, sequence_parallel=True),
    "llama": LLAMA,
    "llama_sp": dict(LLAMA, sequence_parallel=True),
    "llama_sp_checkpoint": dict(LLAMA, sequence_parallel=True, checkpoint_activations=True, hidden_dropout=0.2),
}


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, BASE["vocab_size"], (BATCH, BASE["seq_length"] + 1), generator=g)
    weights = torch.rand(BATCH, BASE["seq_length"], generator=g)  # a non-uniform loss weighting
    return tokens[:, :-1], tokens[:, 1:], weights


def run_case(config: GPTConfig, tp_group=None) -> dict:
    """Loss, logits and every gradient of one forward/backward (the same code at any TP)."""
    tokens, labels, weights = batch()
    model = GPTModel(config, tp_group=tp_group)
    torch.manual_seed(123)  # same RNG on every rank and at TP=1: dropout masks agree
    loss = model(tokens, labels)
    (loss * weights).sum().backward()
    with torch.no_grad():
        logits = model.eval()(tokens)
    return {"loss": loss.detach(), "logits": logits,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


# At TP>1 attention dropout draws from a per-rank stream, so these are compared with each other only.
ATTENTION_DROPOUT = dict(LLAMA, attention_dropout=0.3, attention_backend="reference")
TP2_ONLY = {"attn_dropout": ATTENTION_DROPOUT,
            "attn_dropout_checkpoint": dict(ATTENTION_DROPOUT, checkpoint_activations=True),
            "llama_bf16_sp": dict(LLAMA, sequence_parallel=True, params_dtype=torch.bfloat16)}


def piece_shapes(config: GPTConfig, tp_group=None) -> list[dict]:
    """Parameter shapes of each piece ``gpt_stage_specs`` builds."""
    return [{n: tuple(p.shape) for n, p in spec.build().named_parameters()}
            for spec in gpt_stage_specs(config, tp_group=tp_group)]


def tp2_worker() -> dict:
    st = state.get_state()
    assert st.tp_size == TP
    results = {name: run_case(GPTConfig(**kw), st.tp_group) for name, kw in {**CASES, **TP2_ONLY}.items()}
    # the same calls without a group, in this TP=2 world: the whole model, no communication
    results["no_group"] = run_case(GPTConfig(**CASES["llama_sp"]))
    results["pieces"] = {"sliced": piece_shapes(GPTConfig(**LLAMA), st.tp_group),
                         "whole": piece_shapes(GPTConfig(**LLAMA))}
    one_kv_head = GPTConfig(**dict(LLAMA, num_key_value_heads=1))  # cannot split over 2 ranks
    results["one_kv_head_whole"] = sum(p.numel() for p in GPTModel(one_kv_head).parameters())
    for build in (lambda: GPTModel(one_kv_head, tp_group=st.tp_group),
                  lambda: gpt_stage_specs(one_kv_head, tp_group=st.tp_group)):
        with pytest.raises(ModelConfigError, match="--num-key-value-heads 1 must be divisible by "
                                                   "--tensor-model-parallel-size 2"):
            build()
    return results


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_on_ranks(tp2_worker, TP, tp=TP)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = 1e-5 * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(tp2, case):
    config = GPTConfig(**CASES[case])
    reference = run_case(config)
    params = dict(GPTModel(config).named_parameters())  # for the partition attributes
    for r, result in enumerate(tp2):
        got = result[case]
        close(got["loss"], reference["loss"], f"{case} rank {r} loss")
        close(got["logits"], reference["logits"].chunk(TP, dim=-1)[r], f"{case} rank {r} logits (vocab slice)")
        assert got["grads"].keys() == reference["grads"].keys()
        for name, full in reference["grads"].items():
            p = params[name]
            expected = (slice_chunks(full, p.partition_splits, p.partition_dim, TP, r)
                        if getattr(p, "tensor_model_parallel", False) else full)
            close(got["grads"][name], expected, f"{case} rank {r} grad of {name}")


def test_sequence_parallel_marks_replicated_params(tp2):
    config = GPTConfig(**CASES["gpt2_sp"])
    marked = {n for n, p in GPTModel(config).named_parameters() if getattr(p, "sequence_parallel", False)}
    assert "final_norm.norm.weight" in marked and "layers.0.attention.proj.bias" in marked
    assert "embedding.position_embeddings" in marked
    assert not any("qkv" in n or "fc1" in n for n in marked)


def test_tp2_attention_dropout_replays_under_checkpointing(tp2):
    for r, result in enumerate(tp2):
        plain, ckpt = result["attn_dropout"], result["attn_dropout_checkpoint"]
        close(ckpt["loss"], plain["loss"], f"rank {r} loss")
        for name, grad in plain["grads"].items():
            close(ckpt["grads"][name], grad, f"rank {r} grad of {name}")
    # and the dropout did act: the loss differs from the run without it
    assert not torch.allclose(tp2[0]["attn_dropout"]["loss"], tp2[0]["llama"]["loss"])


def test_tp2_bf16_params_close_to_tp1(tp2):
    """bf16 weights and collectives: the same model up to bf16 rounding (loss within 1e-2 relative)."""
    config = GPTConfig(**TP2_ONLY["llama_bf16_sp"])
    reference = run_case(config)
    for r, result in enumerate(tp2):
        got = result["llama_bf16_sp"]
        assert got["loss"].dtype == torch.float32 and got["logits"].dtype == torch.bfloat16
        assert all(g.dtype == torch.bfloat16 for g in got["grads"].values())
        err = (got["loss"] - reference["loss"]).abs().max().item()
        assert err <= 1e-2 * reference["loss"].abs().max().item(), f"rank {r} bf16 loss error {err:.3g}"


def test_model_depends_only_on_its_arguments(tp2):
    """Under a TP=2 parallel state, GPTModel(config) is the whole model; tp_group=... slices it."""
    config = GPTConfig(**CASES["llama_sp"])
    reference = run_case(config)
    for r, result in enumerate(tp2):
        got = result["no_group"]
        close(got["loss"], reference["loss"], f"rank {r} loss without a group")
        close(got["logits"], reference["logits"], f"rank {r} logits without a group (full vocabulary)")
        assert got["grads"].keys() == reference["grads"].keys()
        for name, full in reference["grads"].items():
            close(got["grads"][name], full, f"rank {r} grad of {name} without a group")
        # the stage specs likewise: the group passed in, and only it, slices the pieces
        whole, sliced = result["pieces"]["whole"], result["pieces"]["sliced"]
        assert whole == piece_shapes(GPTConfig(**LLAMA))
        h, v = LLAMA["hidden_size"], LLAMA["vocab_size"]
        assert (whole[0]["word_embeddings.weight"], sliced[0]["word_embeddings.weight"]) == ((v, h), (v // TP, h))
        assert sliced[1]["attention.qkv.local.weight"][0] * TP == whole[1]["attention.qkv.local.weight"][0]
        assert sliced[-1]["linear.local.weight"] == (v // TP, h)
        # a shape that cannot split over the group is refused where the group enters (see tp2_worker)
        assert result["one_kv_head_whole"] == GPTConfig(**dict(LLAMA, num_key_value_heads=1)).num_parameters()


def pipeline_worker() -> dict:
    """This rank's stage of DeepSpeed's PipelineModule built from the stage specs (TP=2 x PP=2)."""
    import deepspeed

    from megatron_ds.training.engine import pipeline_module

    st = state.get_state()
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    module = pipeline_module(GPTConfig(**GPT2), st)
    pieces = [m for m in module.modules() if hasattr(m, "group") and m is not module]

    def layers_here(last: int | None) -> list[list[int]]:  # the split, and this stage's layer numbers
        five = pipeline_module(GPTConfig(**dict(GPT2, num_layers=5)), st, last)
        return [five.stage_layers, [m.layer_number for m in five.modules() if isinstance(m, TransformerLayer)]]

    return {"pp_rank": st.pp_rank, "shapes": {n: tuple(p.shape) for n, p in module.named_parameters()},
            "all_pieces_on_tp_group": bool(pieces) and all(m.group is st.tp_group for m in pieces),
            "five_layers": layers_here(None), "five_layers_last_1": layers_here(1)}


def test_deepspeed_pipeline_builds_pieces_with_the_tp_group():
    """The group travels in the specs' keyword arguments through LayerSpec and TiedLayerSpec."""
    h, v = GPT2["hidden_size"], GPT2["vocab_size"]
    results = run_on_ranks(pipeline_worker, 4, tp=TP, pp=2)
    assert sorted(r["pp_rank"] for r in results) == [0, 0, 1, 1]
    for r, result in enumerate(results):
        shapes = result["shapes"]
        assert result["all_pieces_on_tp_group"], f"rank {r}"
        # the tied embedding on the first stage and the tied head on the last: this rank's vocab rows
        assert shapes["tied_modules.embed.word_embeddings.weight"] == (v // TP, h), f"rank {r}"
        qkv = [shape for name, shape in shapes.items() if name.endswith("attention.qkv.local.weight")]
        assert qkv == [(3 * h // TP, h)], f"rank {r}: one layer per stage, heads split: {qkv}"
        assert ("tied_modules.embed.position_embeddings" in shapes) == (result["pp_rank"] == 0)
        # our stage boundaries, not DeepSpeed's: 5 layers run 3 | 2 (the head ~0.16 layers), 4 | 1 with the flag
        first = result["pp_rank"] == 0
        assert result["five_layers"] == [[3, 2], [1, 2, 3] if first else [4, 5]], f"rank {r}"
        assert result["five_layers_last_1"] == [[4, 1], [1, 2, 3, 4] if first else [5]], f"rank {r}"
