"""The LLaMA path's attention inputs, checked against the formulations they replaced: grouped-query k, v handed to
SDPA unrepeated (``enable_gqa``) where torch's fused kernels take them, and rotary tables made once and passed
into the (compiled) layer instead of recomputed in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.model import attention, gpt
from megatron_ds.model.attention import CoreAttention, sdpa_takes_gqa
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel, TransformerLayer, apply_rotary, rotary_tables
from megatron_ds.torch_support import torch_version

LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
             seq_length=8, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=3,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape, what
    tol = rel * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def loss_and_grads(config: GPTConfig):
    model = GPTModel(config)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=g)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class SDPACalls:
    """Records the keyword arguments and k's head count of every F.scaled_dot_product_attention call."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[dict, int]] = []
        real = F.scaled_dot_product_attention

        def recording(q, k, v, **kwargs):
            self.calls.append((kwargs, k.size(1)))
            return real(q, k, v, **kwargs)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)


# ---------------------------------------------------------------------------------------- grouped-query attention

def qkv_gqa(requires_grad: bool = True):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 12, 6, 8, generator=g)  # [b, s, nq, d], 3 query heads per kv head
    k, v = torch.randn(2, 12, 2, 8, generator=g), torch.randn(2, 12, 2, 8, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def run_sdpa(native_gqa: bool):
    q, k, v = qkv_gqa()
    out = attention._sdpa(q, k, v, 0.0, native_gqa=native_gqa)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
    return out.detach(), q.grad, k.grad, v.grad


def test_sdpa_native_gqa_equals_the_repeated_kv(monkeypatch):
    """enable_gqa=True gives the outputs and q, k, v gradients of repeating each kv head first (fp32, CPU)."""
    calls = SDPACalls(monkeypatch)
    native, repeated = run_sdpa(native_gqa=True), run_sdpa(native_gqa=False)
    for what, a, b in zip(("output", "dq", "dk", "dv"), native, repeated):
        close(a, b, f"native GQA vs repeated kv: {what}")
    if torch_version() >= (2, 5):
        assert calls.calls == [({"dropout_p": 0.0, "is_causal": True, "enable_gqa": True}, 2),
                               ({"dropout_p": 0.0, "is_causal": True}, 6)]


def test_sdpa_without_the_enable_gqa_keyword_repeats_kv(monkeypatch):
    """Torch < 2.5 (the MS-AMP image's 2.1) has no enable_gqa: the kv heads are repeated, whatever was asked."""
    calls = SDPACalls(monkeypatch)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 1))
    old_torch = run_sdpa(native_gqa=True)
    assert calls.calls == [({"dropout_p": 0.0, "is_causal": True}, 6)]
    for what, a, b in zip(("output", "dq", "dk", "dv"), old_torch, run_sdpa(native_gqa=False)):
        assert torch.equal(a, b), what


def test_native_gqa_only_where_torchs_fused_kernels_take_it(monkeypatch):
    """flash and cuDNN take nkv < nq heads; fp32 (memory-efficient kernel), pre-sm80 GPUs, ROCm and torch < 2.5
    would land on the math kernel (or lack the keyword), so they keep the repeat."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 11))
    assert sdpa_takes_gqa(torch.bfloat16, cuda=True) and sdpa_takes_gqa(torch.float16, cuda=True)
    assert not sdpa_takes_gqa(torch.float32, cuda=True)
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 1))
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)


def test_core_built_for_gpu_repeats_kv_where_it_runs_on_cpu(monkeypatch):
    """A core built with native GQA still repeats kv when its inputs are not CUDA bf16/fp16 (a CPU run of a model
    built on a GPU machine, fp32 under autocast), and gives the same outputs."""
    calls = SDPACalls(monkeypatch)
    core = CoreAttention("sdpa")
    assert not core.native_gqa  # fp32 params here
    core.native_gqa = True  # as built on an sm90 GPU with bf16 params
    q, k, v = qkv_gqa(requires_grad=False)
    close(core(q, k, v), CoreAttention("reference")(q, k, v), "core on CPU vs reference")
    assert calls.calls == [({"dropout_p": 0.0, "is_causal": True}, 6)]
    assert "native_gqa=True" in repr(core)


# ------------------------------------------------------------------------------------------------- rotary tables

def previous_rotary_tables(seq_length, head_dim, base, device, first=0):
    """The tables as the model computed them before: [s, 1, 1, d], both halves of d turning together."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(first, first + seq_length, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def previous_apply_rotary(x, cos, sin):
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("first", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_the_previous_formulation(first, dtype):
    x = torch.randn(16, 2, 3, 12, generator=torch.Generator().manual_seed(2)).to(dtype)  # [s, b, n, d]
    new = apply_rotary(x, *rotary_tables(16, 12, 10000, "cpu", first))
    old = previous_apply_rotary(x, *previous_rotary_tables(16, 12, 10000, "cpu", first))
    # the same fp32 products and sums (bitwise equal on torch 2.13's CPU); bf16: at most one rounding step apart
    close(new.float(), old.float(), f"rotary (first {first}, {dtype})", rel=1e-6 if dtype == torch.float32 else 8e-3)
    if dtype == torch.float32:
        close(new.norm(dim=-1), x.norm(dim=-1), "a rotation keeps each head's norm")


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_model_gives_the_previous_formulations_loss_and_grads(rotary_percent, monkeypatch):
    """The LLaMA model with cached tables passed into the layers equals the model that computed them in each layer
    (the old tables and rotation patched back in), the whole and a partial rotation."""
    config = GPTConfig(**dict(LLAMA, rotary_percent=rotary_percent))
    new = loss_and_grads(config)
    monkeypatch.setattr(gpt, "rotary_tables", previous_rotary_tables)
    monkeypatch.setattr(gpt, "apply_rotary", previous_apply_rotary)
    old = loss_and_grads(config)
    close(new[0], old[0], "loss")
    for name in new[1]:
        close(new[1][name], old[1][name], f"grad of {name}")


def test_rotary_tables_are_made_once_and_usable_after_inference_mode():
    a = rotary_tables(8, 4, 10000, "cpu")
    assert all(x is y for x, y in zip(a, rotary_tables(8, 4, 10000.0, torch.device("cpu"))))
    assert a[0].shape == (8, 1, 1, 4) and a[0].dtype == torch.float32 and not a[0].requires_grad
    with torch.inference_mode():  # an evaluation makes the tables first ...
        cos, sin = rotary_tables(8, 4, 500, "cpu", first=3)
    x = torch.randn(8, 1, 1, 4, requires_grad=True)
    apply_rotary(x, cos, sin).sum().backward()  # ... and training saves them for its backward
    assert x.grad is not None
    expected = previous_rotary_tables(8, 4, 500, "cpu", first=3)
    close(cos[..., :2], expected[0][..., :2], "cos", rel=1e-6)
    close(sin[..., 2:], expected[1][..., 2:], "sin", rel=1e-6)
    close(-sin[..., :2], expected[1][..., :2], "-sin on the first half", rel=1e-6)


@pytest.mark.needs_torch_compile
def test_the_compiled_layer_takes_the_tables_as_inputs():
    """The layer's (compiled) forward gets cos and sin as arguments: no cos or sin is computed in its graph."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = TransformerLayer(GPTConfig(**LLAMA), 1)
    eager = layer.body
    x = torch.randn(LLAMA["seq_length"], 2, LLAMA["hidden_size"], requires_grad=True)
    expected = layer(x)
    layer.body = torch.compile(eager, backend=capture)
    close(layer(x), expected.detach(), "captured layer vs eager")
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}
    assert not {t for t in targets if "cos" in t or "sin" in t}, targets
    cos, _ = layer.attention.rope(x)
    inputs = [n.meta.get("example_value") for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert sum(isinstance(t, torch.Tensor) and t.shape == cos.shape for t in inputs) == 2  # cos and sin
    torch._dynamo.reset()


def test_swiglu_takes_gate_and_up_from_two_gemms_on_the_fused_weight():
    """fc1 returns gate and up as two tensors (two GEMMs on the rows of the one [gate; up] parameter): the MLP's
    output and gradients are those of one GEMM whose output is chunked, and the checkpoint keeps one fused weight."""
    cfg = GPTConfig(**LLAMA)
    mlp = gpt.MLP(cfg, layer_number=1, group=None)
    x = torch.randn(8, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert isinstance(mlp.fc1(x), tuple) and list(mlp.state_dict()) == ["fc1.local.weight", "fc2.local.weight"]
    y = mlp(x)
    y.square().sum().backward()
    got = (y.detach(), x.grad.clone(), mlp.fc1.weight.grad.clone(), mlp.fc2.weight.grad.clone())
    w1 = mlp.fc1.weight.detach().clone().requires_grad_()
    w2 = mlp.fc2.weight.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    gate, up = F.linear(x2, w1).chunk(2, dim=-1)
    y2 = F.linear(F.silu(gate) * up, w2)
    y2.square().sum().backward()
    for a, b in zip(got, (y2.detach(), x2.grad, w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_attention_takes_q_k_v_from_three_gemms_on_the_fused_weight():
    """qkv returns q, k and v as three tensors (three GEMMs on the rows of the one fused parameter): the rotated
    heads and their gradients are those of one GEMM whose output is split, and the checkpoint keeps one weight."""
    attention = gpt.SelfAttention(GPTConfig(**LLAMA), layer_number=1, group=None)
    x0 = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0))
    assert isinstance(attention.qkv(x0), tuple)
    assert list(attention.state_dict()) == ["qkv.local.weight", "proj.local.weight"]

    def heads_and_grads():
        x = x0.clone().requires_grad_()
        attention.zero_grad()
        heads = attention.heads(x)
        sum(h.square().sum() for h in heads).backward()
        return [h.detach() for h in heads] + [x.grad, attention.qkv.weight.grad.clone()]

    three = heads_and_grads()
    attention.qkv.local.outputs = None  # one GEMM, its output split in heads()
    for a, b in zip(three, heads_and_grads(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_qkv_and_swiglu_stay_one_gemm_where_the_tp_overlap_splits_or_pipelines_it():
    """Under --tp-comm-overlap chunked (the GEMM split by sequence chunks) and pipeline (torch's fused all-gather +
    GEMM) qkv and fc1 keep their one GEMM call; every other layout takes their parts apart."""
    assert gpt.MLP(GPTConfig(**LLAMA), 1, None).fc1.local.outputs == [48, 48]
    assert gpt.SelfAttention(GPTConfig(**LLAMA), 1, None).qkv.local.outputs == [32, 16, 16]
    for mode in ("chunked", "pipeline"):  # set after validation, which asks for the compiled layers (torch >= 2.5)
        config = GPTConfig(**dict(LLAMA, sequence_parallel=True))
        config.tp_comm_overlap = mode
        assert gpt.MLP(config, 1, None).fc1.local.outputs is None, mode
        assert gpt.SelfAttention(config, 1, None).qkv.local.outputs is None, mode


def _zero3_mlp_saved_tensors() -> dict:
    """One rank: an MLP built under deepspeed.zero.Init (ZeRO-3 partitions its weights), run with them gathered;
    which tensors autograd saves that share the fc1 weight's storage, and the outputs against the plain MLP's."""
    import deepspeed

    cfg = GPTConfig(**LLAMA)
    plain = gpt.MLP(cfg, layer_number=1, group=None)
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        mlp = gpt.MLP(cfg, layer_number=1, group=None)
    x = torch.randn(8, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    saved = []
    with deepspeed.zero.GatheredParameters(list(mlp.parameters())):
        mlp.load_state_dict(plain.state_dict())
        weight = mlp.fc1.weight
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = mlp(x)
        views = [tuple(t.shape) for t in saved
                 if t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() and t.shape != weight.shape]
        return {"partitioned": hasattr(weight, "ds_id"), "views": views, "y": y.detach(), "plain": plain(x).detach()}


def test_zero3_weights_keep_one_gemm_so_no_view_of_the_gathered_weight_is_held():
    """Under ZeRO-3 fc1 runs its one GEMM (the chunks cut from its output): two GEMMs on views of the gathered
    weight would make autograd keep the whole weight from the layer's forward to its backward."""
    from megatron_ds.parallel.testing import run_on_ranks

    (got,) = run_on_ranks(_zero3_mlp_saved_tensors, 1, tp=1)
    assert got["partitioned"] and got["views"] == []
    torch.testing.assert_close(got["y"], got["plain"])
