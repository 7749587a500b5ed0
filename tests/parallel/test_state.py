"""Parallel dims arithmetic, rank layout against DeepSpeed's topology, and real groups on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ds.parallel import state
from megatron_ds.parallel.state import ParallelConfigError, ParallelDims
from megatron_ds.parallel.testing import run_on_ranks


def test_dims_error_names_every_factor():
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(world=6, tp=4, pp=1)
    message = str(err.value)
    for text in ("world size 6", "tensor-model-parallel-size 4", "pipeline-model-parallel-size 1"):
        assert text in message
    with pytest.raises(ParallelConfigError, match="tensor-model-parallel-size must be a positive integer"):
        ParallelDims(world=2, tp=0, pp=1)


def test_rank_layout_is_tp_fastest_then_dp_then_pp():
    dims = ParallelDims(world=16, tp=2, pp=2)
    assert dims.dp == 4
    for rank in range(16):
        pp, dp, tp = dims.coords(rank)
        assert rank == pp * 8 + dp * 2 + tp == dims.rank_of(pp, dp, tp)
    assert dims.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert dims.dp_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.pp_groups()[:2] == [[0, 8], [1, 9]]


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1), (1, 4), (2, 1)])
def test_rank_layout_matches_deepspeed_topology(tp, pp):
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    world = 8
    dims = ParallelDims(world, tp, pp)
    ds = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dims.dp)
    canon = lambda groups: sorted(sorted(g) for g in groups)  # noqa: E731
    assert canon(dims.tp_groups()) == canon(ds.get_axis_comm_lists("model") or [[r] for r in range(world)])
    assert canon(dims.dp_groups()) == canon(ds.get_axis_comm_lists("data") or [[r] for r in range(world)])
    assert canon(dims.pp_groups()) == canon(ds.get_axis_comm_lists("pipe") or [[r] for r in range(world)])


def test_single_process_state_without_distributed():
    st = state.get_state()
    assert (st.tp_size, st.dp_size, st.pp_size, st.tp_rank) == (1, 1, 1, 0)
    assert st.tp_group is None


def groups_worker() -> dict:
    st = state.get_state()
    mpu = state.mpu()
    probe = torch.tensor([float(st.rank + 1)])
    sums = {}
    for name, group in (("tp", st.tp_group), ("dp", st.dp_group), ("pp", st.pp_group)):
        t = probe.clone()
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    return {
        "coords": (st.pp_rank, st.dp_rank, st.tp_rank),
        "sizes": (st.pp_size, st.dp_size, st.tp_size),
        "sums": sums,
        "mpu": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_world_size(), mpu.get_data_parallel_rank(),
                mpu.get_data_parallel_world_size(), mpu.get_pipe_parallel_world_size(),
                mpu.get_data_parallel_group_ranks(), mpu.get_tensor_model_parallel_src_rank()),
        "mpu_groups_are_state_groups": (mpu.get_model_parallel_group() is st.tp_group
                                        and mpu.get_data_parallel_group() is st.dp_group
                                        and mpu.get_pipe_parallel_group() is st.pp_group),
    }


def test_groups_on_two_ranks_tp2():
    ranks = run_on_ranks(groups_worker, 2, tp=2)
    assert [r["coords"] for r in ranks] == [(0, 0, 0), (0, 0, 1)]
    assert all(r["sums"] == {"tp": 3.0, "dp": float(i + 1), "pp": float(i + 1)} for i, r in enumerate(ranks))
    assert [r["mpu"] for r in ranks] == [(0, 2, 2, 0, 1, 1, [0], 0), (1, 2, 2, 0, 1, 1, [1], 0)]
    assert all(r["mpu_groups_are_state_groups"] for r in ranks)


def test_groups_on_two_ranks_dp2():
    ranks = run_on_ranks(groups_worker, 2, tp=1)
    assert [r["coords"] for r in ranks] == [(0, 0, 0), (0, 1, 0)]
    assert all(r["sums"] == {"tp": float(i + 1), "dp": 3.0, "pp": float(i + 1)} for i, r in enumerate(ranks))
    assert [r["mpu"] for r in ranks] == [(0, 1, 1, 0, 2, 1, [0, 1], 0), (0, 1, 1, 1, 2, 1, [0, 1], 1)]
