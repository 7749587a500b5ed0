"""torchao float8 behind the seam, on the CPU: which modules it swaps, what stays, training steps, checkpoints.

torchao's float8 casts and scaled matrix multiply run on the CPU with this torch, so the converted model
really trains here (the GPU speed and the 300-step loss comparison are bench/device.sh's `fp8` stage).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel, Norm
from megatron_ds.parallel.layers import ColumnParallelLinear, LocalGEMM, RowParallelLinear, VocabParallelEmbedding
from megatron_ds.precision.fp8 import FP8Options, local_gemms
from megatron_ds.precision.fp8_torchao import TorchaoEngine

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=3,
            params_dtype=torch.bfloat16)
LLAMA = dict(BASE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_key_value_heads=2,
             ffn_hidden_size=128, untie_embeddings_and_output_weights=True, add_bias_linear=False)
STYLES = {"gpt2": BASE, "llama": LLAMA}


def batch(config: GPTConfig, step: int, b: int = 4):
    g = torch.Generator().manual_seed(100 + step)
    # a learnable pattern: each sequence counts up from a random start
    start = torch.randint(0, config.vocab_size, (b, 1), generator=g)
    tokens = (start + torch.arange(config.seq_length + 1)) % config.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train(model: torch.nn.Module, config: GPTConfig, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens, labels = batch(config, step)
        loss = model(tokens, labels).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("style", STYLES)
def test_only_the_transformer_layers_gemms_become_float8(style):
    config = GPTConfig(**STYLES[style])
    model = GPTModel(config)
    before = dict(model.named_parameters())
    chosen = local_gemms(model)
    assert sorted(chosen) == sorted(f"layers.{i}.{n}.local" for i in range(2)
                                    for n in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"))
    TorchaoEngine(FP8Options()).convert(model)
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(chosen)
    # TP layers keep their class and communication; only their `local` child changed
    for name in chosen:
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        assert isinstance(parent, (ColumnParallelLinear, RowParallelLinear))
        assert type(parent).forward in (ColumnParallelLinear.forward, RowParallelLinear.forward)
    # the embedding, the untied output head and every norm stay high precision
    assert isinstance(model.embedding.word_embeddings, VocabParallelEmbedding)
    if config.untie_embeddings_and_output_weights:
        assert type(model.output_head.linear.local) is LocalGEMM
    norms = [m for name, m in model.named_modules() if name.endswith("norm") and name != "final_norm"]
    assert len(norms) == 5 and all(type(m) is Norm for m in norms)
    # the same Parameter objects under the same names (optimizer, DeepSpeed, checkpoints see no change)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert after["layers.0.attention.qkv.local.weight"].tensor_model_parallel
    assert after["layers.0.attention.qkv.local.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("style", STYLES)
def test_float8_model_trains_on_cpu_close_to_bf16(style):
    config = GPTConfig(**STYLES[style])
    reference = GPTModel(config)
    fp8 = TorchaoEngine(FP8Options()).convert(copy.deepcopy(reference))
    tokens, labels = batch(config, 0)
    with torch.no_grad():
        first_bf16, first_fp8 = reference(tokens, labels).mean(), fp8(tokens, labels).mean()
    assert first_fp8 != first_bf16  # the GEMMs really ran in float8
    assert abs(first_fp8 / first_bf16 - 1) < 0.01
    steps = 30
    bf16_losses, fp8_losses = train(reference, config, steps), train(fp8, config, steps)
    assert fp8_losses[-1] < 0.7 * fp8_losses[0], fp8_losses  # it learns
    for step, (a, b) in enumerate(zip(bf16_losses, fp8_losses)):
        assert abs(b / a - 1) < 0.02, f"step {step}: fp8 {b:.4f} vs bf16 {a:.4f}"


def test_recipes_and_formats():
    e5m2, e4m3 = torch.float8_e5m2, torch.float8_e4m3fn
    assert TorchaoEngine(FP8Options()).config().cast_config_grad_output.target_dtype == e5m2
    assert TorchaoEngine(FP8Options(format="e4m3")).config().cast_config_grad_output.target_dtype == e4m3
    rowwise = TorchaoEngine(FP8Options(recipe="rowwise")).config()
    assert rowwise.cast_config_input.scaling_granularity.name == "AXISWISE"
    config = GPTConfig(**LLAMA)
    for options in (FP8Options(format="e4m3"), FP8Options(recipe="rowwise")):
        model = TorchaoEngine(options).convert(GPTModel(config))
        tokens, labels = batch(config, 0)
        model(tokens, labels).mean().backward()
        assert model.layers[0].mlp.fc1.weight.grad is not None


def test_state_dict_round_trip_and_older_names_load():
    config = GPTConfig(**LLAMA)
    trained = TorchaoEngine(FP8Options()).convert(GPTModel(config))
    train(trained, config, 2)
    state = trained.state_dict()
    assert "layers.0.attention.qkv.local.weight" in state and "layers.0.attention.qkv.weight" not in state
    # no FP8 state: dynamic scaling computes every scale from the current tensor
    assert all(not k.endswith("_extra_state") for k in state)
    restored = TorchaoEngine(FP8Options()).convert(GPTModel(dict_config(config, seed=99)))
    restored.load_state_dict(state)
    tokens, labels = batch(config, 5)
    with torch.no_grad():
        assert torch.equal(trained(tokens, labels), restored(tokens, labels))
    # a checkpoint written before the `local` child existed: qkv.weight, fc1.weight, proj.weight, linear.weight
    gpt2 = GPTConfig(**BASE)
    source = GPTModel(gpt2)
    legacy = {k.replace(".local.", "."): v for k, v in source.state_dict().items()}
    assert "layers.1.attention.qkv.bias" in legacy and "layers.1.mlp.fc2.weight" in legacy
    target = GPTModel(dict_config(gpt2, seed=7))
    target.load_state_dict(legacy)  # strict: every key mapped, none left over
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    fp8_target = TorchaoEngine(FP8Options()).convert(GPTModel(dict_config(gpt2, seed=7)))
    fp8_target.load_state_dict(legacy)
    assert torch.equal(fp8_target.layers[0].attention.qkv.weight, source.layers[0].attention.qkv.weight)


def dict_config(config: GPTConfig, **changes) -> GPTConfig:
    from dataclasses import asdict

    return GPTConfig(**{**asdict(config), **changes})


def test_precision_wrap_model_is_the_engines_conversion():
    from megatron_ds.arguments import parse_args
    from megatron_ds.arguments.settings import PrecisionSettings, section_from
    from megatron_ds.precision import precision_from

    args = parse_args(["--num-layers", "2", "--bf16", "--fp8-format", "e4m3"], env={})
    precision = precision_from(section_from(PrecisionSettings, args), args.transformer_impl)
    model = GPTModel(GPTConfig(**LLAMA))
    chosen = set(local_gemms(model))
    model = precision.wrap_model(model)
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == chosen and len(chosen) == 8
    assert model.layers[1].mlp.fc2.local.config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn


def test_doctor_runs_one_float8_linear_forward_and_backward():
    import torchao

    from megatron_ds.runtime.doctor import _torchao

    assert _torchao(torchao) == "Float8Linear forward and backward ok on the CPU"


def test_inductor_kernel_tuning_is_off_unless_the_user_turns_it_on(monkeypatch):
    """Coordinate-descent tuning of the fused amax/cast kernels is the user's choice (torch's own
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING): converting never turns it on, GPU or not, and the start-up line
    says when it is on."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor, "coordinate_descent_tuning", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU node answers
    engine = TorchaoEngine(FP8Options())
    engine.convert(GPTModel(GPTConfig(**BASE)))
    assert not inductor.coordinate_descent_tuning and "tunes" not in engine.describe()
    monkeypatch.setattr(inductor, "coordinate_descent_tuning", True)  # the user's TORCHINDUCTOR_ variable
    engine.convert(GPTModel(GPTConfig(**BASE)))
    assert inductor.coordinate_descent_tuning and "inductor tunes its fused kernels" in engine.describe()
