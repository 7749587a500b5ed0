"""DeepSpeed-Ulysses' all-to-all pair (parallel/mappings.py) on real gloo ranks: each rank's heads of the whole
sequence forward, each rank's slice of the gradient backward, for 2 and 4 ranks and 16-bit floats."""

from __future__ import annotations

import pytest
import torch

from megatron_ds.parallel import mappings, state
from megatron_ds.parallel.testing import run_on_ranks

B, S, N, D = 2, 8, 4, 3


def whole(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A [b, s, n, d] tensor every rank draws alike (the unsplit activation or gradient)."""
    return torch.randn(B, S, N, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def worker(dtype: torch.dtype) -> dict:
    st = state.get_state()
    group, sp, r = st.sp_group, st.sp_size, st.sp_rank
    s = S // sp
    x = whole(1, dtype)[:, r * s:(r + 1) * s].clone().requires_grad_()  # this rank's sequence slice
    heads = mappings.sequence_to_heads(x, group)
    back = mappings.heads_to_sequence(heads, group)
    upstream = whole(2, dtype)[:, :, r * N // sp:(r + 1) * N // sp]  # d loss / d heads on this rank
    (heads * upstream).sum().backward()
    y = whole(3, dtype)[:, :, r * N // sp:(r + 1) * N // sp].clone().requires_grad_()  # this rank's heads
    slice_out = mappings.heads_to_sequence(y, group)
    (slice_out * whole(4, dtype)[:, r * s:(r + 1) * s]).sum().backward()
    return {"heads": heads.detach(), "back": back.detach(), "x_grad": x.grad, "slice": slice_out.detach(),
            "y_grad": y.grad}


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sequence_to_heads_and_back_move_whole_heads_and_their_gradients(sp, dtype):
    results = run_on_ranks(worker, sp, dtype, sp=sp)
    s, n = S // sp, N // sp
    for r, got in enumerate(results):
        mine = slice(r * n, (r + 1) * n)
        slice_r = slice(r * s, (r + 1) * s)
        # all-to-all moves bytes: every value is exact, in any dtype
        assert torch.equal(got["heads"], whole(1, dtype)[:, :, mine]), f"rank {r}: forward heads"
        assert torch.equal(got["back"], whole(1, dtype)[:, slice_r]), f"rank {r}: round trip"
        # the gradient of sum(heads * upstream) w.r.t. this rank's slice: every rank's upstream for its heads
        assert torch.equal(got["x_grad"], whole(2, dtype)[:, slice_r]), f"rank {r}: backward of sequence_to_heads"
        assert torch.equal(got["slice"], whole(3, dtype)[:, slice_r]), f"rank {r}: heads_to_sequence forward"
        assert torch.equal(got["y_grad"], whole(4, dtype)[:, :, mine]), f"rank {r}: backward of heads_to_sequence"


def test_the_pair_is_the_identity_without_a_group_and_refuses_split_heads():
    x = torch.randn(B, S, N, D)
    assert mappings.sequence_to_heads(x, None) is x and mappings.heads_to_sequence(x, None) is x
    with pytest.raises(RuntimeError, match="ValueError: cannot give 3 sequence-parallel ranks whole heads of 4"):
        run_on_ranks(_three_ranks_four_heads, 3, sp=3)


def _three_ranks_four_heads() -> None:
    st = state.get_state()
    mappings.sequence_to_heads(torch.zeros(B, 2, N, D), st.sp_group)
