"""Single-process GPT checks: attention backends, checkpointing, pipeline pieces, init, FLOPs, dtypes."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_ds.model
from megatron_ds.model.attention import CoreAttention, resolve_backend
from megatron_ds.model.config import GPTConfig, ModelConfigError
from megatron_ds.model.gpt import EmbeddingStage, GPTModel, TransformerLayer, gpt_stage_specs, lm_loss, recompute_plan

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=3)
LLAMA = dict(BASE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_key_value_heads=2,
             ffn_hidden_size=48, untie_embeddings_and_output_weights=True, add_bias_linear=False)
STYLES = {"gpt2": BASE, "llama": LLAMA}


def batch(config: GPTConfig, b: int = 2):
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, config.vocab_size, (b, config.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: torch.nn.Module, config: GPTConfig, seed: int = 0):
    tokens, labels = batch(config)
    torch.manual_seed(seed)
    loss = model(tokens, labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape, what
    tol = rel * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def assert_same_run(a, b, what: str, rel: float = 1e-5) -> None:
    close(a[0], b[0], f"{what}: loss", rel)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        close(a[1][name], b[1][name], f"{what}: grad of {name}", rel)


@pytest.mark.parametrize("style", STYLES)
def test_loss_starts_near_uniform_and_grads_flow(style):
    config = GPTConfig(**STYLES[style])
    model = GPTModel(config)
    loss, grads = loss_and_grads(model, config)
    assert loss.shape == (2, config.seq_length) and loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(config.vocab_size)) < 0.2  # small init: near-uniform logits
    assert all(g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if g.abs().sum() == 0]
    tokens, _ = batch(config)
    assert model(tokens).shape == (2, config.seq_length, config.vocab_size)


@pytest.mark.parametrize("style", STYLES)
def test_sdpa_equals_reference_attention(style):
    runs = {}
    for backend in ("sdpa", "reference"):
        config = GPTConfig(**dict(STYLES[style], attention_backend=backend))
        model = GPTModel(config)
        assert model.attention_backend == backend
        runs[backend] = loss_and_grads(model, config)
    assert_same_run(runs["sdpa"], runs["reference"], f"{style} sdpa vs reference")


def test_gqa_attention_matches_explicit_head_mapping():
    """Query head i attends with kv head i // (nq / nkv), for every backend."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g),
               torch.randn(2, 5, 2, 8, generator=g))
    for backend in ("sdpa", "reference"):
        out = CoreAttention(backend)(q, k, v)
        for head in range(4):
            one = CoreAttention("reference")(q[:, :, head:head + 1], k[:, :, head // 2:head // 2 + 1],
                                             v[:, :, head // 2:head // 2 + 1])
            close(out[:, :, head:head + 1], one, f"{backend} head {head}")
    # causal: the first position sees only itself
    close(CoreAttention("sdpa")(q, k, v)[:, 0], v[:, 0].repeat_interleave(2, dim=1), "position 0 = its own value")


def test_backend_resolution_on_this_machine():
    assert resolve_backend("auto", torch.float32, cuda=True) == "sdpa"  # flash-attn needs half precision
    assert resolve_backend("auto", torch.bfloat16, cuda=False) == "sdpa"
    assert resolve_backend("reference") == "reference"
    with pytest.raises(ValueError, match="flash2 cannot run: .*no CUDA device"):
        resolve_backend("flash2", torch.bfloat16, cuda=False)
    with pytest.raises(ValueError, match="flash-attn needs bf16 or fp16"):
        resolve_backend("flash2", torch.float32, cuda=True)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("flash1")
    if not torch.cuda.is_available():
        assert GPTModel(GPTConfig(**dict(BASE, attention_backend="auto"))).attention_backend == "sdpa"


@pytest.mark.parametrize("style", STYLES)
def test_activation_checkpointing_gives_the_same_gradients(style):
    # with dropout: the non-reentrant checkpoint replays the RNG, so masks agree in the recompute
    kw = dict(STYLES[style], hidden_dropout=0.3, attention_dropout=0.3, attention_backend="reference")
    plain = GPTConfig(**kw)
    ckpt = GPTConfig(**dict(kw, checkpoint_activations=True))
    assert_same_run(loss_and_grads(GPTModel(ckpt).train(), ckpt, seed=4),
                    loss_and_grads(GPTModel(plain).train(), plain, seed=4), f"{style} checkpointed")


RECOMPUTE = {
    "selective": dict(recompute_granularity="selective"),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_megatron_recompute_policies_give_the_same_gradients(recompute):
    kw = dict(LLAMA, num_layers=3, hidden_dropout=0.3, attention_dropout=0.3, attention_backend="reference")
    plain, config = GPTConfig(**kw), GPTConfig(**dict(kw, **RECOMPUTE[recompute]))
    model = GPTModel(config).train()
    modes = [layer.recompute for layer in model.layers]
    expected = {"selective": ["selective"] * 3, "full_uniform_2": [None] * 3, "full_block_1": ["full", None, None]}
    assert modes == expected[recompute] and model.recompute_chunk == (2 if recompute == "full_uniform_2" else 1)
    assert [layer.attention.recompute_core for layer in model.layers] == [recompute == "selective"] * 3
    assert_same_run(loss_and_grads(model, config, seed=4), loss_and_grads(GPTModel(plain).train(), plain, seed=4),
                    recompute)
    with pytest.raises(ModelConfigError, match="--recompute-granularity full needs --recompute-method"):
        GPTConfig(**dict(kw, recompute_granularity="full"))


def test_recompute_is_planned_per_stage_and_reaches_the_pipeline_specs():
    """Block counts layers within each pipeline stage; under a pipeline every layer checkpoints itself (no chunks)."""
    kw = dict(LLAMA, num_layers=4)
    block = GPTConfig(**dict(kw, **RECOMPUTE["full_block_1"]))
    assert recompute_plan(block, [2, 2]) == (["full", None, "full", None], 1)
    specs = gpt_stage_specs(block, stage_layers=[2, 2])
    assert [s.build().recompute for s in specs if s.kind == "layer"] == ["full", None, "full", None]
    uniform = GPTConfig(**dict(kw, **RECOMPUTE["full_uniform_2"]))
    assert recompute_plan(uniform) == ([None] * 4, 2)
    assert recompute_plan(uniform, [3, 1]) == (["full"] * 4, 1)


def test_rotary_percent_rotates_the_first_dims_only():
    from megatron_ds.model.gpt import apply_rotary, rotary_tables

    config = GPTConfig(**dict(LLAMA, rotary_percent=0.5))
    d, r = config.head_dim, config.rotary_dim
    assert r == d // 2
    attention = GPTModel(config).layers[0].attention
    x = torch.randn(5, 2, attention.local_q_heads, d)
    cos, sin = rotary_tables(5, r, config.rotary_base, x.device)
    rotated = apply_rotary(x[..., :r], cos, sin)
    assert not torch.equal(rotated, x[..., :r])
    full = GPTModel(GPTConfig(**LLAMA))
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 8))
    assert not torch.allclose(GPTModel(config)(tokens), full(tokens))  # the same weights, other positions
    with pytest.raises(ModelConfigError, match="--rotary-percent"):
        GPTConfig(**dict(LLAMA, rotary_percent=0.01))


def test_torch_compile_gives_the_eager_model(monkeypatch):
    """--torch-compile: every layer runs one compiled graph (inductor's CPU backend here) with the eager
    loss and gradients, also under activation checkpointing."""
    from megatron_ds.torch_support import compile_problem

    if compile_problem():  # torch 2.1 (make test-torch21): refused up front, naming the flag
        with pytest.raises(ModelConfigError, match=r"--torch-compile needs torch >= 2.5"):
            GPTConfig(**dict(LLAMA, torch_compile=True))
        return
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plain = GPTConfig(**LLAMA)
    reference = loss_and_grads(GPTModel(plain), plain)
    for extra in ({}, {"checkpoint_activations": True}):
        config = GPTConfig(**dict(LLAMA, torch_compile=True, **extra))
        assert_same_run(loss_and_grads(GPTModel(config), config), reference, f"compiled {extra}", rel=1e-4)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    GPTConfig(**dict(LLAMA, torch_compile=True)).validate(2)  # TP compiles (functional collectives)
    monkeypatch.setenv("MDS_TP_COLLECTIVES", "inplace")  # the collectives torch 2.11 mis-routes when compiled
    with pytest.raises(ModelConfigError, match=r"--torch-compile not with --tensor-model-parallel-size 2 and "
                                               r"MDS_TP_COLLECTIVES=inplace"):
        GPTConfig(**dict(LLAMA, torch_compile=True)).validate(2)


def test_compiled_final_rmsnorm_is_the_eager_norm():
    """--torch-compile runs the final RMSNorm compiled too (eager it is many kernels over fp32 copies), with the
    eager output and gradients and the same parameter names; LayerNorm (one kernel eager) stays eager."""
    from megatron_ds.model.compiled import CompiledForward
    from megatron_ds.model.gpt import FinalNorm
    from megatron_ds.torch_support import compile_problem

    assert not isinstance(FinalNorm(GPTConfig(**LLAMA)).body, CompiledForward)
    if compile_problem():
        return
    import torch._dynamo

    assert not isinstance(FinalNorm(GPTConfig(**dict(BASE, torch_compile=True))).body, CompiledForward)
    torch._dynamo.reset()
    eager, compiled = FinalNorm(GPTConfig(**LLAMA)), FinalNorm(GPTConfig(**dict(LLAMA, torch_compile=True)))
    assert isinstance(compiled.body, CompiledForward)
    assert list(compiled.state_dict()) == list(eager.state_dict()) == ["norm.weight"]
    g = torch.Generator().manual_seed(4)
    weight = torch.rand(LLAMA["hidden_size"], generator=g) + 0.5
    with torch.no_grad():
        for norm in (eager, compiled):
            norm.norm.weight.copy_(weight)
    x = torch.randn(LLAMA["seq_length"], 2, LLAMA["hidden_size"], generator=g)
    grad = torch.randn(x.shape, generator=g)
    runs = []
    for norm in (compiled, eager):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        runs.append((out.detach(), xi.grad, norm.norm.weight.grad))
    for what, a, b in zip(("output", "input grad", "weight grad"), *runs):
        close(a, b, f"compiled final RMSNorm: {what}")


def test_compiled_layers_draw_the_eager_dropout_masks(monkeypatch):
    """The layers compile with ATen's dropout (compiled.LAYER_OPTIONS): with dropout on, the compiled model
    gives the eager loss and gradients for the same seed, also when activation checkpointing recomputes the
    layers; inductor's own random numbers would not."""
    from megatron_ds.torch_support import compile_problem

    dropout = dict(LLAMA, hidden_dropout=0.1, attention_dropout=0.1)
    if compile_problem():  # torch 2.1: refused up front, with dropout too
        with pytest.raises(ModelConfigError, match=r"--torch-compile needs torch >= 2.5"):
            GPTConfig(**dict(dropout, torch_compile=True))
        return
    import torch._dynamo

    eager = GPTConfig(**dropout)
    reference = loss_and_grads(GPTModel(eager), eager)
    for extra in ({}, {"checkpoint_activations": True}):  # the recompute must replay the same masks
        config = GPTConfig(**dict(dropout, torch_compile=True, **extra))
        torch._dynamo.reset()
        assert_same_run(loss_and_grads(GPTModel(config), config), reference, f"compiled with dropout {extra}",
                        rel=1e-4)
    compiled = GPTConfig(**dict(dropout, torch_compile=True))
    monkeypatch.setenv("MDS_INDUCTOR_OPTIONS", '{"fallback_random": false}')  # inductor's own random numbers
    torch._dynamo.reset()
    own = loss_and_grads(GPTModel(compiled), compiled)
    assert (own[0] - reference[0]).abs().max() > 1e-3, "inductor's own dropout drew the eager masks"
    monkeypatch.setenv("MDS_INDUCTOR_OPTIONS", "fallback_random")
    with pytest.raises(ValueError, match="MDS_INDUCTOR_OPTIONS='fallback_random' is not JSON"):
        GPTModel(compiled)


@pytest.mark.parametrize("style", STYLES)
def test_pipeline_pieces_compose_to_gpt_model(style):
    config = GPTConfig(**STYLES[style])
    specs = gpt_stage_specs(config)
    assert [s.kind for s in specs] == ["embedding", "layer", "layer", "final_norm", "head"]
    assert all(s.kwargs["tp_group"] is None for s in specs)  # every piece is told its group (here: TP=1)
    tied = config.tied_embeddings
    assert (specs[0].tied_key, specs[-1].tied_key) == (("embed", "embed") if tied else (None, None))
    modules = [spec.build() for spec in specs]
    tokens, labels = batch(config)
    hidden = tokens
    for spec, module in zip(specs, modules):
        hidden = spec(module, hidden)
        if spec.kind in ("embedding", "layer", "final_norm"):
            assert hidden.shape == (config.seq_length, 2, config.hidden_size)  # one [s, b, h] tensor between stages
    loss = lm_loss(hidden, labels, None)
    loss.mean().backward()
    reference = loss_and_grads(GPTModel(config), config)
    close(loss.detach(), reference[0], f"{style} pipeline loss")
    # the same parameters, by construction, with the same gradients (tied weight: sum of both uses)
    prefixes = ["embedding."] + [f"layers.{n}." for n in range(config.num_layers)] + ["final_norm."]
    prefixes.append("embedding." if tied else "output_head.")
    grads: dict[str, torch.Tensor] = {}
    for prefix, module in zip(prefixes, modules):
        for name, p in module.named_parameters():
            grads[prefix + name] = grads[prefix + name] + p.grad if prefix + name in grads else p.grad
    assert grads.keys() == reference[1].keys()
    for name, grad in grads.items():
        close(grad, reference[1][name], f"{style} pipeline grad of {name}")
    if tied:
        assert dict(modules[-1].named_parameters()).keys() == {"word_embeddings.weight"}  # no positions on the head


def test_a_stage_builds_only_its_layers_with_the_full_models_weights():
    config = GPTConfig(**dict(LLAMA, num_layers=4))
    full = GPTModel(config)
    second_stage = [TransformerLayer(config, n) for n in (3, 4)]  # what PP=2's last stage builds
    for module, reference in zip(second_stage, full.layers[2:]):
        for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
            assert torch.equal(p, q), name
    head = EmbeddingStage(config, positions=False)
    assert torch.equal(head.weight, full.embedding.weight)
    assert not torch.equal(full.layers[0].mlp.fc1.weight, full.layers[1].mlp.fc1.weight)


def test_layer_options_come_from_the_config_as_the_layer_is_built():
    """--tp-comm-overlap reaches the parallel linears through their constructors and chooses, with --torch-compile,
    the forward a layer runs (``body``): nothing sets them on a built layer."""
    from megatron_ds.model.compiled import CompiledForward
    from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_ds.torch_support import compile_problem

    def linears(layer):
        return [m for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]

    plain = TransformerLayer(GPTConfig(**BASE), 1)
    assert plain.body == plain._forward
    assert not any(m.chunked or m.local.bias_apart for m in linears(plain))
    halves = TransformerLayer(GPTConfig(**dict(BASE, tp_comm_overlap="halves")), 1)
    assert halves.body == halves._halves_forward
    if compile_problem():  # torch 2.1: the compiled modes are refused up front
        return
    sp = dict(BASE, sequence_parallel=True, torch_compile=True)
    chunked = TransformerLayer(GPTConfig(**dict(sp, tp_comm_overlap="chunked")), 1)
    assert isinstance(chunked.body, CompiledForward) and chunked.body.eager == chunked._forward
    assert [m.chunked for m in linears(chunked)] == [True] * 4
    assert not any(m.local.bias_apart for m in linears(chunked))
    pipeline = TransformerLayer(GPTConfig(**dict(sp, tp_comm_overlap="pipeline")), 1)
    assert [m.local.bias_apart for m in linears(pipeline)] == [True, False, True, False]  # qkv, proj, fc1, fc2
    assert not any(m.chunked for m in linears(pipeline))
    compiled_halves = TransformerLayer(GPTConfig(**dict(BASE, torch_compile=True, tp_comm_overlap="halves")), 1)
    assert compiled_halves.body.eager == compiled_halves._halves_forward


def test_init_std_scaled_for_residual_projections():
    config = GPTConfig(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=128, seq_length=8,
                       init_method_std=0.02)
    layer = TransformerLayer(config, 1)
    scaled = 0.02 / math.sqrt(2 * 8)
    for name, std in (("attention.qkv.local.weight", 0.02), ("mlp.fc1.local.weight", 0.02),
                      ("attention.proj.local.weight", scaled), ("mlp.fc2.local.weight", scaled)):
        p = layer.get_parameter(name)
        assert abs(p.std().item() / std - 1) < 0.03, f"{name}: std {p.std().item():.5f}, want {std:.5f}"
    assert torch.count_nonzero(layer.attention.qkv.bias) == 0


def test_bf16_params_loss_in_fp32():
    config32 = GPTConfig(**LLAMA)
    config16 = GPTConfig(**dict(LLAMA, params_dtype=torch.bfloat16))
    model = GPTModel(config16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens, labels = batch(config16)
    loss = model(tokens, labels)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    reference = GPTModel(config32)(tokens, labels)
    close(loss.detach(), reference.detach(), "bf16 loss vs fp32 loss", rel=2e-2)


def test_flops_per_token_by_hand():
    # h=64, 4 heads of 16, 2 kv heads, ffn 96 (swiglu), s=16, V=128, 2 layers, by hand:
    #   qkv   2 * 64 * (64 + 2 * 32)   = 16384
    #   attn  2 * 16 * 64 * 2          =  4096   (scores and values, full sequence)
    #   proj  2 * 64 * 64              =  8192
    #   mlp   2 * 64 * 96 * 3          = 36864
    #   per layer 65536; x2 layers 131072; logits 2 * 64 * 128 = 16384; forward 147456; x3 = 442368
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       ffn_hidden_size=96, swiglu=True, seq_length=16, vocab_size=128)
    assert config.flops_per_token() == 442368
    # Megatron's closed form for GPT (MHA, ffn 4h): 72 L h^2 (1 + s / (6 h) + V / (12 L h)) per token
    L, h, s, V = 24, 1024, 2048, 50304
    gpt = GPTConfig(num_layers=L, hidden_size=h, num_attention_heads=16, seq_length=s, vocab_size=V)
    assert gpt.flops_per_token() == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-12)


@pytest.mark.parametrize("style", STYLES)
def test_num_parameters_counts_the_built_model(style):
    config = GPTConfig(**STYLES[style])
    assert config.num_parameters() == sum(p.numel() for p in GPTModel(config).parameters())


def test_config_errors_name_the_flag():
    with pytest.raises(ModelConfigError, match="--num-attention-heads 4 must be divisible by --num-key-value-heads 3"):
        GPTConfig(**dict(BASE, num_key_value_heads=3))
    config = GPTConfig(**LLAMA)
    with pytest.raises(ModelConfigError, match="--num-key-value-heads 2 must be divisible by "
                                               "--tensor-model-parallel-size 4"):
        config.validate(tp=4)
    with pytest.raises(ModelConfigError, match="--sequence-parallel needs --seq-length 6 divisible"):
        GPTConfig(**dict(BASE, seq_length=6, sequence_parallel=True)).validate(tp=4)
    assert GPTConfig(**dict(BASE, swiglu=True, hidden_size=4096, num_attention_heads=32)).ffn_hidden_size == 10880


def _imported_names(path: Path) -> list[str]:
    """Every module or name an ``import`` statement of ``path`` reaches, dotted (relative ones with their dots)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_the_model_never_imports_the_parallel_state():
    """The model depends only on its arguments: the TP group is passed in, never read from a global."""
    model_dir = Path(megatron_ds.model.__file__).parent
    sources = sorted(model_dir.rglob("*.py"))
    assert {p.name for p in sources} >= {"gpt.py", "attention.py", "config.py"}
    for path in sources:
        offending = [n for n in _imported_names(path) if "parallel.state" in n]
        assert not offending, f"{path.relative_to(model_dir.parent.parent)} imports {offending}"
        assert "get_state" not in path.read_text(), f"{path.name} reads the global parallel state"
    # not even indirectly: importing the model leaves the parallel state module unloaded
    code = "import sys, megatron_ds.model; print('megatron_ds.parallel.state' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_sequence_longer_than_positions_is_an_error():
    config = GPTConfig(**BASE)
    tokens = torch.zeros(1, config.seq_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds --max-position-embeddings 8"):
        GPTModel(config)(tokens)


@pytest.mark.gpu
def test_flash2_equals_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    runs = {}
    for backend in ("flash2", "sdpa"):
        config = GPTConfig(**dict(LLAMA, attention_backend=backend, params_dtype=torch.bfloat16, seq_length=64))
        model = GPTModel(config).cuda()
        assert model.attention_backend == backend
        tokens, labels = (t.cuda() for t in batch(config))
        loss = model(tokens, labels)
        loss.mean().backward()
        runs[backend] = (loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
    assert_same_run(runs["flash2"], runs["sdpa"], "flash2 vs sdpa (bf16)", rel=2e-2)


def test_rotary_tables_of_a_slice_are_the_full_tables_rows():
    """Ulysses: a rank holding positions [first, first + s) rotates with exactly those rows."""
    from megatron_ds.model.gpt import rotary_tables

    cos, sin = rotary_tables(16, 8, 10000, "cpu")
    cos_part, sin_part = rotary_tables(4, 8, 10000, "cpu", first=8)
    assert torch.equal(cos_part, cos[8:12]) and torch.equal(sin_part, sin[8:12])


def test_building_and_running_an_eager_model_leaves_dynamo_unimported():
    """The launcher validates flags by importing the model, and every CPU rank builds one: importing dynamo
    (sympy, inductor) cost each of those processes ~1 s before it was deferred to the first compiled layer."""
    code = ("import sys, torch\n"
            "before = set(sys.modules)  # what torch itself imports (torch 2.1 brings sympy along)\n"
            "from megatron_ds.model.config import GPTConfig\n"
            "from megatron_ds.model.gpt import GPTModel\n"
            "from megatron_ds.arguments import parse_args\n"
            "model = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,"
            " seq_length=4, attention_backend='sdpa'))\n"
            "model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()\n"
            "print(sorted(m for m in set(sys.modules) - before\n"
            "             if m.startswith(('torch._dynamo', 'torch._inductor', 'sympy')))[:5])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
