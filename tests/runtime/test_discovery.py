import socket

import pytest

from megatron_ds.runtime.discovery import DiscoveryError, discover, job_port

HOST = socket.gethostname()

# (name, env, expected fields)
CASES = [
    ("none", {}, dict(source="none", rank=0, world_size=1, local_rank=0, num_nodes=1, master_addr="127.0.0.1",
                      master_port=29500)),
    ("torchrun", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                  "MASTER_ADDR": "n0", "MASTER_PORT": "1234"},
     dict(source="env", rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
          master_addr="n0", master_port=1234)),
    ("slurm task per GPU", {"SLURM_PROCID": "9", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                            "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
                            "SLURM_STEP_NODELIST": "nid[001-002]", "SLURM_JOB_ID": "4242"},
     dict(source="slurm", rank=9, world_size=16, local_rank=1, local_world_size=8, node_rank=1, num_nodes=2,
          nodes=("nid001", "nid002"), master_addr="nid001", master_port=job_port("4242"), job_id="4242")),
    ("slurm task per node", {"SLURM_PROCID": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
                             "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
                             "SLURM_STEP_NODELIST": "gpu-a[01-02],gpu-b7", "SLURM_JOB_ID": "7"},
     dict(source="slurm", rank=2, world_size=3, local_world_size=1, node_rank=2, num_nodes=3, master_addr="gpu-a01")),
    ("slurm master overridden", {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
                                 "SLURM_STEP_NODELIST": "nid001", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "999"},
     dict(master_addr="10.0.0.1", master_port=999)),
    ("pals", {"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "8", "PMI_LOCAL_SIZE": "4",
              "PALS_NODEID": "1", "PBS_JOBID": "123.polaris-pbs-01", "MASTER_ADDR": "x3005c0s13b0n0"},
     dict(source="pals", rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2)),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h0"},
     dict(source="openmpi", rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2,
          master_addr="h0")),
    ("openmpi one node", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     dict(source="openmpi", rank=1, world_size=2, num_nodes=1, master_addr="127.0.0.1")),
    ("mpich", {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"},
     dict(source="mpich", rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1, num_nodes=2)),
    ("pmix", {"PMIX_RANK": "1", "PMIX_SIZE": "2", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
     dict(source="pmix", rank=1, world_size=2, local_rank=1, num_nodes=1)),
    ("flux", {"FLUX_TASK_RANK": "3", "FLUX_TASK_LOCAL_ID": "1", "FLUX_JOB_SIZE": "4", "FLUX_JOB_NNODES": "2",
              "FLUX_JOB_ID": "f2Xy", "MASTER_ADDR": "h0"},
     dict(source="flux", rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2,
          master_port=job_port("f2Xy"))),
    ("torchrun wins over slurm", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "SLURM_PROCID": "3",
                                  "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"},
     dict(source="env", rank=0, world_size=1)),
    ("slurm batch script is not a step", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"},
     dict(source="none")),
    # mpirun inside an allocation: its ranks inherit the SLURM_* of the srun step that started its daemons
    ("mpirun inside a slurm allocation", {"SLURM_PROCID": "1", "SLURM_STEP_ID": "1", "SLURM_NTASKS": "2",
                                          "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                                          "SLURM_STEP_NODELIST": "n[1-2]", "OMPI_COMM_WORLD_RANK": "5",
                                          "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                                          "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n1"},
     dict(source="openmpi", rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2)),
    ("mpiexec (hydra) inside a slurm allocation, rank 0", {"SLURM_PROCID": "0", "SLURM_STEP_ID": "2",
                                                           "SLURM_NTASKS": "2", "PMI_RANK": "0", "PMI_SIZE": "8",
                                                           "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4",
                                                           "MASTER_ADDR": "n1"},
     dict(source="mpich", rank=0, world_size=8, local_world_size=4, num_nodes=2)),
    ("srun with pmix agrees with slurm", {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
                                          "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_STEP_NODELIST": "n1",
                                          "PMIX_RANK": "3", "PMIX_SIZE": "4"},
     dict(source="slurm", rank=3, world_size=4, local_world_size=4)),
]


@pytest.mark.parametrize("name, env, expected", CASES, ids=[c[0] for c in CASES])
def test_discover(name, env, expected):
    info = discover(env)
    for field, value in expected.items():
        assert getattr(info, field) == value, f"{name}: {field}"


def test_pals_nodes_from_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3005c0s13b0n0\nx3005c0s13b0n0\nx3005c0s19b1n0\nx3005c0s19b1n0\n")
    info = discover({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PMI_SIZE": "4", "PMI_LOCAL_SIZE": "2",
                     "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "77.pbs"})
    assert info.nodes == ("x3005c0s13b0n0", "x3005c0s19b1n0")
    assert info.num_nodes == 2 and info.master_addr == "x3005c0s13b0n0" and info.master_port == job_port("77.pbs")


def test_job_ports_differ_between_jobs():
    assert job_port("1001") != job_port("1002")
    assert 20000 <= job_port("123456789") < 50000


# (env, variables the message must name)
ERRORS = [
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["RANK=3", "WORLD_SIZE=2"]),
    ({"RANK": "0"}, ["WORLD_SIZE"]),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["RANK='x'"]),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
     ["LOCAL_WORLD_SIZE=3", "WORLD_SIZE=4"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2",
      "SLURM_STEP_NUM_NODES": "1"}, ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS=4"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
      "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "nid[001-003]"},
     ["SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES=2"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "nid[001-"},
     ["hostlist"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ["MASTER_ADDR"]),
    ({"FLUX_TASK_RANK": "0", "FLUX_JOB_SIZE": "5", "FLUX_TASK_LOCAL_ID": "0", "FLUX_JOB_NNODES": "2"},
     ["FLUX_JOB_SIZE=5", "FLUX_JOB_NNODES"]),
    ({"PMIX_RANK": "0"}, ["PMIX_SIZE"]),
    ({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PMI_SIZE": "8", "PMI_LOCAL_SIZE": "4"}, ["MASTER_ADDR"]),
]


@pytest.mark.parametrize("env, names", ERRORS)
def test_inconsistent_variables_are_named(env, names):
    with pytest.raises(DiscoveryError) as err:
        discover(env)
    for name in names:
        assert name in str(err.value)


# What a task sees in Slurm 22.05's OCI container steps (srun --container, read from a real bookworm Slurm): srun
# outside a batch script hands the container the step's variables but no SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID;
# inside a batch script the container gets the batch shell's variables (SLURM_PROCID=0 and SLURM_LOCALID=0 among
# them, SLURM_TASK_PID naming the batch shell) and nothing of its step.
def _step_without_task_variables(nodes: str, tasks: int, nnodes: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "41", "SLURM_JOBID": "41", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nnodes),
            "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": "1",
            "SLURM_CONTAINER": "/shared/mds-bundle"}


def _batch_shell_variables(nodes: str, nnodes: int, task_pid: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "42", "SLURM_JOBID": "42", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_GTIDS": "0",
            "SLURM_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_NNODES": str(nnodes),
            "SLURM_JOB_NUM_NODES": str(nnodes), "SLURM_TASK_PID": str(task_pid), "ENVIRONMENT": "BATCH",
            "SLURMD_NODENAME": nodes.split(",")[0]}


def _pid_not_an_ancestor() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid  # a finished child: never this process's ancestor


def test_container_step_without_task_variables_is_placed_from_its_node_list():
    """One task per node (22.05's container steps always run so): the rank is this host's place in the step's node
    list, the world the step's task count."""
    info = discover(_step_without_task_variables(f"a0,{HOST},b7", 3, 3))
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 1, 3, 0, 1)
    assert (info.node_rank, info.num_nodes, info.master_addr) == (1, 3, "a0")
    one = discover(_step_without_task_variables(HOST, 1, 1))
    assert (one.rank, one.world_size, one.num_nodes, one.master_port) == (0, 1, 1, job_port("41"))


def test_container_step_in_a_one_node_batch_job_is_rank_0_of_1():
    info = discover(_batch_shell_variables(HOST, 1, _pid_not_an_ancestor()))
    assert (info.source, info.rank, info.world_size, info.num_nodes) == ("slurm", 0, 1, 1)


def test_the_batch_script_itself_is_no_step():
    import os

    assert discover(_batch_shell_variables("a[0-1]", 2, os.getppid())).source == "none"  # our parent: the shell


@pytest.mark.parametrize("env, names", [
    (lambda: _step_without_task_variables(HOST, 2, 1), ["SLURM_PROCID", "22.05", "SLURM_STEP_NUM_TASKS=2", "apptainer",
                                                         "--ntasks-per-node=1"]),
    (lambda: _step_without_task_variables("a0,b7", 2, 2), [f"this host ({HOST})", "SLURM_STEP_NODELIST='a0,b7'",
                                                            "RANK, WORLD_SIZE, LOCAL_RANK"]),
    (lambda: _batch_shell_variables("a[0-1]", 2, _pid_not_an_ancestor()), ["SLURM_STEP_ID", "2 nodes", "24.11"]),
], ids=["two tasks on one node", "host not in the node list", "batch job on two nodes"])
def test_container_step_that_cannot_be_placed_is_an_error_naming_the_limit(env, names):
    with pytest.raises(DiscoveryError) as err:
        discover(env())
    for name in names:
        assert name in str(err.value)
