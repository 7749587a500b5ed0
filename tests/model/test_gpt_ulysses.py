"""GPTModel under DeepSpeed-Ulysses 2 (two real gloo processes, the all-to-all pair of parallel/mappings.py)
against one process, with dropout on, eager and with the layers compiled.

Hidden dropout keeps each rank's rows of the full-sequence mask, so loss and gradients (summed over SP, as
DeepSpeed reduces them) equal the single process's with the same seed. Attention dropout acts on each rank's
own heads after the all-to-all, where the single process's mask over all heads cannot be reproduced: it
draws from a stream private to the SP rank (else heads h and h + n/sp would share one mask), and the shared
stream goes on identically on both ranks.
Tolerance: fp32, max |a - b| <= 1e-5 * max|b| + 1e-7 per tensor.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.parallel import state
from megatron_ds.parallel.testing import run_on_ranks

SP = 2
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=11)
HIDDEN_DROPOUT = {"gpt2": dict(BASE, hidden_dropout=0.3),
                  "llama": dict(BASE, hidden_dropout=0.3, position_embedding_type="rope", normalization="RMSNorm",
                                swiglu=True, num_key_value_heads=2, ffn_hidden_size=48,
                                untie_embeddings_and_output_weights=True, add_bias_linear=False)}
ATTENTION_DROPOUT = dict(BASE, attention_dropout=0.3, attention_backend="reference")


def batch(sp_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels [2, 8]; with ``sp_rank`` that rank's contiguous slice of the sequence."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, BASE["vocab_size"], (2, BASE["seq_length"] + 1), generator=g)
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    if sp_rank is None:
        return tokens, labels
    s = BASE["seq_length"] // SP
    return (tokens[:, sp_rank * s:(sp_rank + 1) * s].contiguous(),
            labels[:, sp_rank * s:(sp_rank + 1) * s].contiguous())


def run_case(config: GPTConfig, sp_group=None, sp_rank: int | None = None) -> dict:
    tokens, labels = batch(sp_rank)
    model = GPTModel(config, sp_group=sp_group)
    torch.manual_seed(123)  # the same shared stream on every rank and in the single process
    loss = model(tokens, labels)  # [b, s] for the full sequence, also under Ulysses
    loss.mean().backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def ulysses_worker() -> dict:
    import torch.distributed as dist

    st = state.get_state()
    results = {}
    for name, kw in HIDDEN_DROPOUT.items():
        result = run_case(GPTConfig(**kw), st.sp_group, st.sp_rank)
        for grad in result["grads"].values():
            dist.all_reduce(grad, group=st.sp_group)  # each rank holds its tokens' share: DeepSpeed sums over SP
        results[name] = result
    # attention dropout: the RNG state the attention core starts from, and the shared one after the forward
    model = GPTModel(GPTConfig(**ATTENTION_DROPOUT), sp_group=st.sp_group)
    seen = []
    model.layers[0].attention.core.register_forward_pre_hook(lambda module, args: seen.append(torch.get_rng_state()))
    tokens, labels = batch(st.sp_rank)
    torch.manual_seed(123)
    results["attention_loss"] = model(tokens, labels).detach()
    results["core_rng"], results["shared_rng_after"] = seen[0], torch.get_rng_state()
    return results


@pytest.fixture(scope="module")
def ulysses2() -> list[dict]:
    return run_on_ranks(ulysses_worker, SP, sp=SP)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = rel * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", list(HIDDEN_DROPOUT))
def test_gpt_ulysses2_hidden_dropout_draws_the_single_process_mask(ulysses2, case):
    config = GPTConfig(**HIDDEN_DROPOUT[case])
    reference = run_case(config)
    without = run_case(GPTConfig(**dict(HIDDEN_DROPOUT[case], hidden_dropout=0.0)))
    assert not torch.allclose(reference["loss"], without["loss"])  # the dropout did act
    for r, result in enumerate(ulysses2):
        close(result[case]["loss"], reference["loss"], f"{case} rank {r} per-token loss")
        for name, grad in reference["grads"].items():
            close(result[case]["grads"][name], grad, f"{case} rank {r} grad of {name} (summed over SP)")


def test_gpt_ulysses2_attention_dropout_draws_a_stream_per_rank(ulysses2):
    first, second = ulysses2
    assert not torch.equal(first["core_rng"], second["core_rng"])  # this rank's heads, its own masks
    assert torch.equal(first["shared_rng_after"], second["shared_rng_after"])  # hidden dropout stays in step
    assert torch.equal(first["attention_loss"], second["attention_loss"])  # the gathered full-sequence loss


def compiled_worker() -> dict:
    """Each HIDDEN_DROPOUT case with its layers compiled: the result (gradients summed over SP), the all-to-alls in
    inductor's generated code, and dynamo's graph breaks."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    st = state.get_state()
    torch.set_num_threads(1)
    results = {}
    for name, kw in HIDDEN_DROPOUT.items():
        torch._dynamo.reset()
        counters.clear()
        result, codes = run_and_get_code(run_case, GPTConfig(**dict(kw, torch_compile=True)), st.sp_group, st.sp_rank)
        for grad in result["grads"].values():
            dist.all_reduce(grad, group=st.sp_group)
        results[name] = {**result, "all_to_alls": sum(code.count("all_to_all_single.default(") for code in codes),
                         "graph_breaks": sum(counters["graph_break"].values())}
    return results


@pytest.mark.needs_torch_compile
@pytest.mark.slow
def test_compiled_ulysses2_puts_the_all_to_alls_in_the_graph_and_gives_the_eager_model():
    """Compiled (inductor on CPU; every layer runs the one layer graph): its generated code holds the two
    all-to-alls of the forward (q, k and v together in, the output back) and the two of the backward, no graph
    break, and the single process's loss and summed gradients (rel 1e-4: fused kernels round differently),
    hidden dropout included (the compiled layers draw the eager masks)."""
    results = run_on_ranks(compiled_worker, SP, sp=SP, timeout=900)
    for case, kw in HIDDEN_DROPOUT.items():
        reference = run_case(GPTConfig(**kw))
        for r, result in enumerate(results):
            got = result[case]
            assert got["graph_breaks"] == 0, f"{case} rank {r}: {got['graph_breaks']} graph breaks"
            assert got["all_to_alls"] == 4, f"{case} rank {r}: {got['all_to_alls']} all-to-alls"
            close(got["loss"], reference["loss"], f"{case} rank {r} loss", rel=1e-4)
            for name, grad in reference["grads"].items():
                close(got["grads"][name], grad, f"{case} rank {r} grad of {name}", rel=1e-4)
