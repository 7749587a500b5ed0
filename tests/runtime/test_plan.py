"""Launch-mode decisions (pure: environment in, plan out)."""

import pytest

from megatron_ds.runtime.bootstrap import make_plan, visible_gpus

SLURM_NODE_1_OF_2 = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                     "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                     "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "99", "CUDA_VISIBLE_DEVICES": ""}


def test_task_per_node_spawns_with_global_ranks():
    plan = make_plan(4, None, SLURM_NODE_1_OF_2)
    assert plan.spawn and plan.nproc == 4
    assert [(r.rank, r.local_rank, r.world_size, r.node_rank) for r in plan.ranks()] == [
        (4, 0, 8, 1), (5, 1, 8, 1), (6, 2, 8, 1), (7, 3, 8, 1)]
    assert {r.master_addr for r in plan.ranks()} == {"gpu07"}


def test_task_per_node_spawns_one_per_visible_gpu():
    plan = make_plan(None, None, dict(SLURM_NODE_1_OF_2, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
    assert plan.spawn and plan.nproc == 8 and plan.ranks()[-1].rank == 15 and "8 visible GPU(s)" in plan.nproc_why


def test_task_per_node_without_gpus_is_one_rank():
    plan = make_plan(None, None, SLURM_NODE_1_OF_2)
    assert not plan.spawn and plan.info.rank == 1 and plan.info.world_size == 2


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
     "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "n[1-2]"},
    {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n1"},
    {"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "3", "PMI_SIZE": "8", "PMI_LOCAL_SIZE": "4", "MASTER_ADDR": "n1"},
])
def test_task_per_gpu_is_one_rank_even_with_nproc(env):
    plan = make_plan(8, None, dict(env, CUDA_VISIBLE_DEVICES="0,1,2,3"))
    assert not plan.spawn and plan.ranks() == [plan.info] and plan.info.rank == 3


def test_no_launcher_spawns_visible_gpus_around_a_store_it_hosts():
    plan = make_plan(None, None, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert plan.spawn and [r.rank for r in plan.ranks()] == [0, 1] and plan.hosts_store
    given = make_plan(None, None, {"CUDA_VISIBLE_DEVICES": "0,1", "MASTER_PORT": "29999"})
    assert given.hosts_store and given.info.master_port == 29999 and plan.info.master_port == 0  # 0: the OS picks
    assert not make_plan(None, None, {"CUDA_VISIBLE_DEVICES": ""}).spawn


@pytest.mark.parametrize("files, count", [
    ({}, 0), ({"dev/nvidia0": "", "dev/nvidia1": "", "dev/nvidiactl": ""}, 2),
    ({"sys/class/kfd/kfd/topology/nodes/0/properties": "cpu_cores_count 64\nsimd_count 0\n",
      "sys/class/kfd/kfd/topology/nodes/1/properties": "simd_count 440\n",
      "sys/class/kfd/kfd/topology/nodes/2/properties": "simd_count 440\n"}, 2),
])
def test_visible_gpus_from_the_filesystem(tmp_path, files, count):
    for rel, content in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    assert visible_gpus({}, root=str(tmp_path)) == count
    assert visible_gpus({"ROCR_VISIBLE_DEVICES": "0,1,2"}, root=str(tmp_path)) == 3


def test_max_restarts_supervises_even_a_single_rank():
    plan = make_plan(None, None, {"CUDA_VISIBLE_DEVICES": ""}, max_restarts=2)
    assert plan.spawn and plan.nproc == 1 and [r.rank for r in plan.ranks()] == [0]
    assert "supervised child for --max-restarts 2" in plan.nproc_why and plan.hosts_store
    one_task_per_node = make_plan(None, None, SLURM_NODE_1_OF_2, max_restarts=1)
    assert one_task_per_node.spawn and [(r.rank, r.world_size) for r in one_task_per_node.ranks()] == [(1, 2)]
    assert not one_task_per_node.hosts_store  # across nodes, the master node's rank 0 serves it


TORCHRUN_RANK_0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                   "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("nproc, restarts, named", [
    (2, 0, "--nproc-per-node ignored"), (None, 3, "--max-restarts ignored"),
    (2, 3, "--nproc-per-node and --max-restarts ignored")])
def test_launcher_flags_another_launcher_owns_are_named_by_rank_0(capsys, nproc, restarts, named):
    plan = make_plan(nproc, None, TORCHRUN_RANK_0, max_restarts=restarts)
    assert not plan.spawn
    err = capsys.readouterr().err
    assert f"mds: WARNING: {named}: RANK is set" in err and "torchrun" in err, err
    make_plan(nproc, None, dict(TORCHRUN_RANK_0, RANK="1", LOCAL_RANK="1"), max_restarts=restarts)
    assert capsys.readouterr().err == ""  # once per job, not once per rank
    make_plan(nproc, None, dict(TORCHRUN_RANK_0, MDS_SUPERVISED="1"), max_restarts=restarts)
    assert capsys.readouterr().err == ""  # a rank we spawned: its parent applied both


def test_max_restarts_under_one_task_per_rank_is_named(capsys):
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "n[1-2]"}
    plan = make_plan(None, None, env, max_restarts=2)
    assert not plan.spawn and plan.info.rank == 0
    err = capsys.readouterr().err
    assert "--max-restarts 2 ignored: slurm runs one task per rank" in err and "--requeue" in err, err
    make_plan(None, None, env)
    assert capsys.readouterr().err == ""
