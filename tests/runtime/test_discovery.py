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
