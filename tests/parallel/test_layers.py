"""Tensor-parallel layers at TP=2 (two real gloo processes) against the full torch computation.

Tolerance: fp32, max |a - b| <= 1e-5 * max|b| + 1e-6 (only the summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.parallel import cross_entropy, mappings, state
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    seeded_normal,
    sequence_parallel_dropout,
    slice_chunks,
    weights_drawn_on,
)
from megatron_ds.parallel.random import tp_rank_rng
from megatron_ds.parallel.testing import run_on_ranks

TP = 2
S, B, H_IN, H_OUT, VOCAB = 6, 2, 8, 12, 16
SPLITS = [4, 8]  # a fused weight of two chunks (as [q; kv] or [gate; up]), each split on its own


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 1e-5 * expected.abs().max().item() + 1e-6
    err = (actual - expected).abs().max().item()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(S, B, H_IN, generator=g),
        "x_wide": torch.randn(S, B, H_OUT, generator=g),
        "dy_out": torch.randn(S, B, H_OUT, generator=g),
        "dy_in": torch.randn(S, B, H_IN, generator=g),
        "tokens": torch.randint(0, VOCAB, (S, B), generator=g),
        "dy_emb": torch.randn(S, B, H_IN, generator=g),
        "logits": 3 * torch.randn(S, B, VOCAB, generator=g),
        "labels": torch.randint(0, VOCAB, (S, B), generator=g),
        "dloss": torch.rand(S, B, generator=g),
    }


def col_init():
    return seeded_normal(0.5, "test", "column")


def row_init():
    return seeded_normal(0.5, "test", "row")


def emb_init():
    return seeded_normal(1.0, "test", "embedding")


def shard(t: torch.Tensor, dim: int, rank: int, splits=None) -> torch.Tensor:
    return slice_chunks(t, splits or [t.size(dim)], dim, TP, rank)


def grads_of(module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


# (sequence parallel, chunked): chunked splits each SP GEMM by the ranks' sequence chunks (parallel/chunked.py)
LAYOUTS = [(False, False), (True, False), (True, True)]


def layout(sp: bool, chunked: bool) -> str:
    return f"sp{sp}" + ("_chunked" if chunked else "")


def tp2_worker() -> dict:
    """Everything at TP=2; returns this rank's outputs and gradients."""
    st = state.get_state()
    group, r = st.tp_group, st.tp_rank
    d = inputs()
    out = {}
    for sp, chunked in LAYOUTS:
        # Column-parallel, input replicated (or sequence shards under SP), output our columns.
        overlap = "chunked" if chunked else None
        col = ColumnParallelLinear(H_IN, H_OUT, init=col_init(), group=group, splits=SPLITS, sequence_parallel=sp,
                                   overlap=overlap)
        x = (shard(d["x"], 0, r) if sp else d["x"]).clone().requires_grad_()
        y = col(x)
        (y * shard(d["dy_out"], -1, r, SPLITS)).sum().backward()
        out[f"col_{layout(sp, chunked)}"] = (y.detach(), x.grad, grads_of(col))
        if not chunked:  # one output per chunk, each from its own GEMM (SwiGLU's gate and up)
            col = ColumnParallelLinear(H_IN, H_OUT, init=col_init(), group=group, splits=SPLITS, sequence_parallel=sp,
                                       separate_outputs=True)
            x = (shard(d["x"], 0, r) if sp else d["x"]).clone().requires_grad_()
            ys = col(x)
            (torch.cat(ys, -1) * shard(d["dy_out"], -1, r, SPLITS)).sum().backward()
            out[f"col_separate_sp{sp}"] = ([y.detach() for y in ys], x.grad, grads_of(col))
        # Row-parallel, input our columns, output summed (or reduce-scattered under SP).
        row = RowParallelLinear(H_OUT, H_IN, init=row_init(), group=group, sequence_parallel=sp, overlap=overlap)
        x = shard(d["x_wide"], -1, r).clone().requires_grad_()
        y = row(x)
        (y * (shard(d["dy_in"], 0, r) if sp else d["dy_in"])).sum().backward()
        out[f"row_{layout(sp, chunked)}"] = (y.detach(), x.grad, grads_of(row))
    col = ColumnParallelLinear(H_IN, H_OUT, init=col_init(), group=group, gather_output=True)
    x = d["x"].clone().requires_grad_()
    y = col(x)
    (y * d["dy_out"]).sum().backward()
    out["col_gather"] = (y.detach(), x.grad, grads_of(col))

    emb = VocabParallelEmbedding(VOCAB, H_IN, init=emb_init(), group=group)
    y = emb.full(d["tokens"])
    (y * d["dy_emb"]).sum().backward()
    out["embedding"] = (y.detach(), None, grads_of(emb))

    logits = shard(d["logits"], -1, r).clone().requires_grad_()
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, d["labels"], group)
    (loss * d["dloss"]).sum().backward()
    out["cross_entropy"] = (loss.detach(), logits.grad, {"unchanged": torch.equal(before, logits.detach())})
    out["mappings"] = mapping_checks(group, r)
    out["rng"] = rng_checks(group)
    return out


def rng_checks(group) -> dict[str, torch.Tensor]:
    """Draws inside tp_rank_rng (private per rank, replayable) and after it (shared again)."""
    torch.manual_seed(42)
    state_before = torch.get_rng_state()
    with tp_rank_rng(group):
        inside = torch.rand(4)
    after = torch.rand(4)
    torch.set_rng_state(state_before)  # what activation checkpointing does before a recompute
    with tp_rank_rng(group):
        replay = torch.rand(4)
    torch.manual_seed(42)
    x = torch.ones(S // TP, B, H_IN)
    return {"inside": inside, "after": after, "replay": replay,
            "sp_dropout": sequence_parallel_dropout(x, 0.5, True, group)}


def mapping_checks(group, r: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Forward value and input gradient of each helper for input (r + 1) * base and gradient ones."""
    base = torch.arange(1.0, 1.0 + 4 * 2).reshape(4, 2)
    result = {}
    for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sequence",
                 "gather_from_sequence", "all_gather_sequence", "reduce_scatter_sequence"):
        x = ((r + 1) * base).requires_grad_()
        y = getattr(mappings, name)(x, group)
        # d/dx of sum((rank + 1) * y): the gradient arriving differs per rank, so reductions show.
        ((r + 1) * y).sum().backward()
        result[name] = (y.detach(), x.grad)
    return result


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_on_ranks(tp2_worker, TP, tp=TP)


def reference_linear(init, shape, x, dy):
    w = init(shape).requires_grad_()
    b = torch.zeros(shape[0], requires_grad=True)
    x = x.clone().requires_grad_()
    y = F.linear(x, w, b)
    (y * dy).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("sp, chunked", LAYOUTS)
def test_column_parallel_matches_full_linear(tp2, sp, chunked):
    d = inputs()
    y, dx, dw, db = reference_linear(col_init(), (H_OUT, H_IN), d["x"], d["dy_out"])
    for r, res in enumerate(tp2):
        y_r, dx_r, g = res[f"col_{layout(sp, chunked)}"]
        close(y_r, shard(y, -1, r, SPLITS), f"rank {r} output")
        close(dx_r, shard(dx, 0, r) if sp else dx, f"rank {r} input grad")
        close(g["local.weight"], shard(dw, 0, r, SPLITS), f"rank {r} weight grad")
        close(g["local.bias"], shard(db, 0, r, SPLITS), f"rank {r} bias grad")


@pytest.mark.parametrize("sp", [False, True])
def test_column_parallel_separate_outputs_are_the_fused_layers_chunks(tp2, sp):
    """separate_outputs: one tensor per chunk of the fused weight, each from its own GEMM; together they are the
    fused layer's output, and the parameter and its gradient are the fused layer's (same checkpoint layout)."""
    d = inputs()
    y, dx, dw, db = reference_linear(col_init(), (H_OUT, H_IN), d["x"], d["dy_out"])
    for r, res in enumerate(tp2):
        ys, dx_r, g = res[f"col_separate_sp{sp}"]
        assert [t.shape[-1] for t in ys] == [n // TP for n in SPLITS]
        close(torch.cat(ys, -1), shard(y, -1, r, SPLITS), f"rank {r} outputs")
        close(dx_r, shard(dx, 0, r) if sp else dx, f"rank {r} input grad")
        close(g["local.weight"], shard(dw, 0, r, SPLITS), f"rank {r} weight grad")
        close(g["local.bias"], shard(db, 0, r, SPLITS), f"rank {r} bias grad")


@pytest.mark.parametrize("what", [dict(gather_output=True), dict(overlap="chunked", sequence_parallel=True),
                                  dict(overlap="pipeline"), dict(splits=None)])
def test_separate_outputs_is_refused_where_the_layer_is_not_one_gemm_call(what):
    args = {"init": col_init(), "splits": SPLITS, "separate_outputs": True, **what}
    with pytest.raises(ValueError, match="separate_outputs"):
        ColumnParallelLinear(H_IN, H_OUT, **args)


def test_column_parallel_gather_output(tp2):
    d = inputs()
    y, dx, dw, _ = reference_linear(col_init(), (H_OUT, H_IN), d["x"], d["dy_out"])
    for r, res in enumerate(tp2):
        y_r, dx_r, g = res["col_gather"]
        close(y_r, y, f"rank {r} output")
        close(dx_r, dx, f"rank {r} input grad")
        close(g["local.weight"], shard(dw, 0, r), f"rank {r} weight grad")


@pytest.mark.parametrize("sp, chunked", LAYOUTS)
def test_row_parallel_matches_full_linear(tp2, sp, chunked):
    d = inputs()
    y, dx, dw, db = reference_linear(row_init(), (H_IN, H_OUT), d["x_wide"], d["dy_in"])
    for r, res in enumerate(tp2):
        y_r, dx_r, g = res[f"row_{layout(sp, chunked)}"]
        close(y_r, shard(y, 0, r) if sp else y, f"rank {r} output")
        close(dx_r, shard(dx, -1, r), f"rank {r} input grad")
        close(g["local.weight"], shard(dw, 1, r), f"rank {r} weight grad")
        # Under SP each rank holds a partial bias gradient until it is summed over TP in backward.
        close(g["bias"], db, f"rank {r} bias grad")


def tp3_chunked_worker() -> dict:
    """Chunked SP linears at TP=3: more than one other rank, and a rank in the middle (the general path)."""
    st = state.get_state()
    group, r = st.tp_group, st.tp_rank
    d = inputs()
    col = ColumnParallelLinear(H_IN, H_OUT, init=col_init(), group=group, sequence_parallel=True, overlap="chunked")
    row = RowParallelLinear(H_OUT, H_IN, init=row_init(), group=group, sequence_parallel=True, overlap="chunked")
    x = d["x"].chunk(3)[r].clone().requires_grad_()
    y = col(x)
    (y * d["dy_out"].chunk(3, -1)[r]).sum().backward()
    x_wide = d["x_wide"].chunk(3, -1)[r].clone().requires_grad_()
    z = row(x_wide)
    (z * d["dy_in"].chunk(3)[r]).sum().backward()
    return {"col": (y.detach(), x.grad, grads_of(col)), "row": (z.detach(), x_wide.grad, grads_of(row))}


def test_chunked_sequence_parallel_linears_match_the_full_ones_at_tp3():
    d = inputs()
    col = reference_linear(col_init(), (H_OUT, H_IN), d["x"], d["dy_out"])
    row = reference_linear(row_init(), (H_IN, H_OUT), d["x_wide"], d["dy_in"])
    for r, res in enumerate(run_on_ranks(tp3_chunked_worker, 3, tp=3)):
        y, dx, g = res["col"]
        close(y, col[0].chunk(3, -1)[r], f"rank {r} column output")
        close(dx, col[1].chunk(3)[r], f"rank {r} column input grad")
        close(g["local.weight"], col[2].chunk(3)[r], f"rank {r} column weight grad")
        z, dx_wide, g = res["row"]
        close(z, row[0].chunk(3)[r], f"rank {r} row output")
        close(dx_wide, row[1].chunk(3, -1)[r], f"rank {r} row input grad")
        close(g["local.weight"], row[2].chunk(3, 1)[r], f"rank {r} row weight grad")
        close(g["bias"], row[3], f"rank {r} row bias grad")


def test_vocab_parallel_embedding_matches_full(tp2):
    d = inputs()
    w = emb_init()((VOCAB, H_IN)).requires_grad_()
    y = F.embedding(d["tokens"], w)
    (y * d["dy_emb"]).sum().backward()
    for r, res in enumerate(tp2):
        y_r, _, g = res["embedding"]
        close(y_r, y.detach(), f"rank {r} embeddings")
        close(g["weight"], shard(w.grad, 0, r), f"rank {r} weight grad")


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp2):
    d = inputs()
    logits = d["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, VOCAB), d["labels"].view(-1), reduction="none").view(S, B)
    (loss * d["dloss"]).sum().backward()
    for r, res in enumerate(tp2):
        loss_r, grad_r, info = res["cross_entropy"]
        assert loss_r.dtype == torch.float32
        close(loss_r, loss.detach(), f"rank {r} loss")
        close(grad_r, shard(logits.grad, -1, r), f"rank {r} logits grad")
        assert info["unchanged"], "the caller's logits were modified in place"


def test_cross_entropy_single_process_bf16_input():
    d = inputs()
    logits = d["logits"].bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, d["labels"])
    loss.sum().backward()
    expected = F.cross_entropy(logits.detach().float().view(-1, VOCAB), d["labels"].view(-1), reduction="none")
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    close(loss, expected.view(S, B), "bf16-input loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_chunking_changes_nothing_and_saves_no_fp32_logits(dtype):
    """Token chunks of any size give the same loss and gradient bit for bit; with bf16 logits no fp32
    tensor of the logits' size is kept for backward (the memory a full fp32 copy would cost)."""
    d = inputs()
    results = []
    for chunk_elements in (1, 3 * VOCAB, 1 << 26):  # one token per chunk, 3 tokens (uneven), everything
        logits = d["logits"].to(dtype).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = vocab_parallel_cross_entropy(logits, d["labels"], chunk_elements=chunk_elements)
        (loss * d["dloss"]).sum().backward()
        results.append((loss.detach(), logits.grad))
        if dtype == torch.bfloat16:
            assert not any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in saved)
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
    logits = d["logits"].to(dtype).float().requires_grad_()
    expected = F.cross_entropy(logits.view(-1, VOCAB), d["labels"].view(-1), reduction="none").view(S, B)
    (expected * d["dloss"]).sum().backward()
    close(results[0][0], expected.detach(), f"{dtype} loss")
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16
    assert (results[0][1].float() - logits.grad).abs().max() <= tol * logits.grad.abs().max() + 1e-6


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.needs_torch_compile)],
                         ids=["chunks", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwriting_the_logits_gives_the_same_gradient_in_their_memory(dtype, fused, monkeypatch):
    """overwrite_logits (the model's own loss): the same loss and gradient bit for bit, in the logits' own
    memory (no second buffer of their size: the compiled kernel stores in place, the chunks write over
    theirs); a second backward through the graph is refused by autograd instead of reading overwritten
    values; leaf logits (the caller's values) are refused."""
    monkeypatch.setattr(cross_entropy, "_compile_failed", False)
    d = inputs()
    runs = {}
    for overwrite in (False, True):
        base = d["logits"].to(dtype).requires_grad_()
        logits = base * 1  # computed in the graph, as the output layer's are
        seen = []
        logits.register_hook(lambda g: seen.append(g))
        loss = vocab_parallel_cross_entropy(logits, d["labels"], chunk_elements=3 * VOCAB, fused=fused,
                                            overwrite_logits=overwrite)
        (loss * d["dloss"]).sum().backward(retain_graph=True)
        runs[overwrite] = (loss.detach(), base.grad, seen[0].data_ptr() == logits.data_ptr())
        if overwrite:
            with pytest.raises(RuntimeError, match="inplace"):
                (loss * d["dloss"]).sum().backward()
    assert not cross_entropy._compile_failed, "the compiled kernels fell back to the eager chunks"
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    assert runs[True][2] and not runs[False][2], "the gradient is not (only) in the logits' memory"
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_cross_entropy(d["logits"].requires_grad_(), d["labels"], overwrite_logits=True)


@pytest.mark.needs_torch_compile
def test_the_compiled_overwriting_kernel_allocates_nothing():
    """Inductor turns the copy_ back into the logits into stores inside the one kernel: its generated code
    allocates no buffer (a temporary of the logits' size is what overwrite_logits is there to save)."""
    from torch._inductor.utils import run_and_get_code

    d = inputs()
    logits = d["logits"].bfloat16().view(-1, VOCAB)
    n = logits.size(0)
    args = (logits.float().amax(-1), torch.rand(n), d["labels"].view(-1), -torch.rand(n))
    expected = cross_entropy._softmax_minus_hit(logits, *args)
    kernel = torch.compile(cross_entropy._softmax_minus_hit_over, dynamic=False)
    out, codes = run_and_get_code(kernel, logits.clone(), *args)
    assert torch.equal(out, expected)
    calls = [code.split("def call(", 1)[1] for code in codes]
    assert calls and not any("empty_strided" in call for call in calls), calls


def test_mappings_are_conjugate_pairs(tp2):
    base = torch.arange(1.0, 1.0 + 4 * 2).reshape(4, 2)
    x = [(r + 1) * base for r in range(TP)]  # rank r's input
    w = [float(r + 1) for r in range(TP)]  # rank r's upstream gradient scale
    total = sum(x)
    cat_last, cat_first = torch.cat(x, dim=-1), torch.cat(x, dim=0)
    ones = torch.ones_like(base)
    for r, res in enumerate(tp2):
        m = res["mappings"]
        expect = {  # name: (forward value, input gradient) on rank r
            "copy_to_tp": (x[r], sum(w) * ones),
            "reduce_from_tp": (total, w[r] * ones),
            "scatter_to_tp": (x[r].chunk(TP, -1)[r], torch.cat([wi * ones.chunk(TP, -1)[r] for wi in w], -1)),
            "gather_from_tp": (cat_last, w[r] * ones),
            "scatter_to_sequence": (x[r].chunk(TP, 0)[r], torch.cat([wi * ones.chunk(TP, 0)[r] for wi in w], 0)),
            "gather_from_sequence": (cat_first, w[r] * ones),
            "all_gather_sequence": (cat_first, sum(w) * ones),
            "reduce_scatter_sequence": (total.chunk(TP, 0)[r], torch.cat([wi * ones.chunk(TP, 0)[r] for wi in w], 0)),
        }
        for name, (value, grad) in expect.items():
            close(m[name][0], value, f"rank {r} {name} forward")
            close(m[name][1], grad, f"rank {r} {name} backward")


def test_helpers_are_identity_without_a_group():
    x = torch.randn(4, 2, requires_grad=True)
    for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sequence",
                 "gather_from_sequence", "all_gather_sequence", "reduce_scatter_sequence"):
        assert getattr(mappings, name)(x, None) is x, name


def test_tp_rank_rng_is_private_per_rank_and_replayable(tp2):
    rng = [res["rng"] for res in tp2]
    assert not torch.equal(rng[0]["inside"], rng[1]["inside"]), "both TP ranks drew the same numbers"
    assert torch.equal(rng[0]["after"], rng[1]["after"]), "the shared stream diverged after the block"
    for r in range(TP):
        assert torch.equal(rng[r]["inside"], rng[r]["replay"]), "restoring the RNG state must replay the block"


def test_sequence_parallel_dropout_is_the_full_sequence_mask(tp2):
    torch.manual_seed(42)
    full = torch.nn.functional.dropout(torch.ones(S, B, H_IN), 0.5, True)
    got = torch.cat([res["rng"]["sp_dropout"] for res in tp2], dim=0)
    assert torch.equal(got, full)


def test_fused_cross_entropy_equals_the_eager_chunks():
    """The compiled kernels (CUDA's default; compiled here with inductor's CPU backend) give the eager
    path's loss and gradient, for bf16 logits, keeping no fp32 copy of the logits."""
    d = inputs()
    results = {}
    for fused in (False, True):
        logits = d["logits"].bfloat16().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = vocab_parallel_cross_entropy(logits, d["labels"], fused=fused)
        (loss * d["dloss"]).sum().backward()
        assert not any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in saved)
        results[fused] = (loss.detach(), logits.grad)
    from megatron_ds.parallel import cross_entropy
    from megatron_ds.torch_support import compile_problem

    assert not cross_entropy._compile_failed, "the compiled kernels fell back to eager"
    if compile_problem():  # torch 2.1 (make test-torch21): the eager chunks run, bit for bit
        assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])
        return
    close(results[True][0], results[False][0], "fused loss")
    grad_eager, grad_fused = results[False][1].float(), results[True][1].float()
    assert (grad_fused - grad_eager).abs().max() <= 1e-2 * grad_eager.abs().max()  # both rounded to bf16


def test_weights_drawn_on_a_device_stay_there_and_the_block_restores_the_cpu_draw():
    """build_engine draws on the rank's GPU (tests/gpu -k drawn_on covers CUDA); here the device is the CPU, whose
    draw must equal the default one, and leaving the block (also by an error) restores the default."""
    draw = seeded_normal(0.5, "test", "drawn")
    default = draw((64, 32))
    with weights_drawn_on(torch.device("cpu")):
        inside = draw((64, 32))
        with torch.device("meta"):
            assert draw((64, 32)).is_meta  # a model built for its shapes only draws nothing
    assert inside.device.type == "cpu" and torch.equal(inside, default)
    with pytest.raises(RuntimeError), weights_drawn_on(torch.device("meta")):
        draw((64, 32))  # meta tensors cannot be drawn: the error leaves the block
    assert torch.equal(draw((64, 32)), default)
