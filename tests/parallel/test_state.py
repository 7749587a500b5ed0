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


# --- DeepSpeed-Ulysses (sp): carved out of data parallelism as Megatron-DeepSpeed does ---------------------

def test_ulysses_layout_sp_neighbours_dp_strides_over_them():
    dims = ParallelDims(8, 1, 1, sp=2)
    assert dims.dp == 4
    # Megatron-DeepSpeed's initialize_model_parallel(sequence_parallel_size=2) at world 8: SP groups of
    # consecutive ranks, DP groups with stride 2, one sequence-data-parallel group of all ranks
    assert dims.sp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.sp_dp_groups() == [list(range(8))]
    assert dims.tp_groups() == [[r] for r in range(8)] and dims.pp_groups() == [[r] for r in range(8)]
    assert [(dims.coords(r)[1], dims.sp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(dims.rank_of(0, *divmod(r, 2)[:1], 0, r % 2) == r for r in range(8))
    # sp = 1 changes nothing
    assert ParallelDims(8, 2, 2).dp_groups() == ParallelDims(8, 2, 2, sp=1).dp_groups()
    assert ParallelDims(8, 2, 2, sp=1).sp_dp_groups() == ParallelDims(8, 2, 2).dp_groups()


@pytest.mark.parametrize("world, tp, pp, sp, text", [
    (4, 2, 1, 2, "cannot be combined with --tensor-model-parallel-size 2"),
    (4, 1, 2, 2, "cannot be combined with --pipeline-model-parallel-size 2"),
    (3, 1, 1, 2, "world size 3 is not divisible by --ds-sequence-parallel-size 2"),
    (2, 1, 1, 0, "--ds-sequence-parallel-size must be a positive integer"),
])
def test_ulysses_layout_errors_name_the_flag(world, tp, pp, sp, text):
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(world, tp, pp, sp)
    assert text in str(err.value) and err.value.flag == "--ds-sequence-parallel-size"


def ulysses_groups_worker(sp: int) -> dict:
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    st = state.init_parallel(1, 1, backend="gloo", sp=sp)
    # torch.distributed is up: only the groups are new
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)  # as build_engine does
    mpu = st.mpu()
    sums = {}
    for name, group in (("sp", st.sp_group), ("dp", st.dp_group), ("sp_dp", st.sp_dp_group)):
        t = torch.tensor([float(st.rank + 1)])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    ds_groups.mpu = mpu  # what deepspeed.initialize(mpu=...) does: DeepSpeed's own group queries read it
    try:
        seen_by_deepspeed = (ds_groups._get_sequence_parallel_world_size(), ds_groups._get_sequence_parallel_rank(),
                             ds_groups._get_sequence_data_parallel_world_size(),
                             ds_groups._get_sequence_data_parallel_rank(), ds_groups._get_data_parallel_world_size(),
                             ds_groups._get_sequence_data_parallel_group() is st.sp_dp_group)
    finally:
        ds_groups.mpu = None
    return {"sums": sums, "sp": (st.sp_size, st.sp_rank, st.dp_size, st.dp_rank), "deepspeed": seen_by_deepspeed,
            "dp_ranks": mpu.get_data_parallel_group_ranks()}


def test_ulysses_groups_on_four_ranks_dp2_sp2():
    ranks = run_on_ranks(ulysses_groups_worker, 4, 2)
    assert [r["sp"] for r in ranks] == [(2, 0, 2, 0), (2, 1, 2, 0), (2, 0, 2, 1), (2, 1, 2, 1)]
    # sp groups {0,1} {2,3}: sums 3 and 7; dp groups {0,2} {1,3}: 4 and 6; sp_dp: all four, 10
    assert [r["sums"] for r in ranks] == [{"sp": 3.0, "dp": 4.0, "sp_dp": 10.0}, {"sp": 3.0, "dp": 6.0, "sp_dp": 10.0},
                                          {"sp": 7.0, "dp": 4.0, "sp_dp": 10.0}, {"sp": 7.0, "dp": 6.0, "sp_dp": 10.0}]
    assert [r["deepspeed"] for r in ranks] == [(2, r % 2, 4, r, 2, True) for r in range(4)]
    assert [r["dp_ranks"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
