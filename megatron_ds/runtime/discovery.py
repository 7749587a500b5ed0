"""Who am I? Rank, world, local rank and nodes from the launcher's variables (pure: env in, RankInfo out).

Launchers are tried in DESIGN.md's order and the first whose variables are present wins:
torchrun/user (`RANK`), Slurm, PALS/PMI (PBS on Cray), Open MPI, MPICH/Intel MPI, PMIx, Flux, none.
Inconsistent values raise DiscoveryError naming the variables: a wrong world size must be an error
at start-up, never a rendezvous that waits forever. A Slurm step that hides its task variables from
the process (Slurm 22.05's OCI containers) is placed from what it does show, or is an error that
names the limit: never a silent "single process".
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_ds.runtime.hostlist import HostlistError, expand_hostlist, parse_tasks_per_node

DEFAULT_PORT = 29500
_PORT_BASE, _PORT_SPAN = 20000, 30000  # job-derived ports stay in [20000, 50000)


class DiscoveryError(ValueError):
    """The launcher's variables contradict each other (message names them)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    nodes: tuple[str, ...]
    master_addr: str
    master_port: int
    # "env" (RANK set: torchrun, our spawner or the user), "slurm", "pals", "openmpi", "mpich", "pmix", "flux", "none"
    source: str
    job_id: str | None = None


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise DiscoveryError(f"{name}={value!r} is not an integer") from None


def _first_int(env: Mapping[str, str], *names: str) -> tuple[str, int] | None:
    for name in names:
        if env.get(name, "") != "":
            return name, _int(env, name)
    return None


def job_port(job_id: str | None) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide."""
    if not job_id:
        return DEFAULT_PORT
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return _PORT_BASE + key % _PORT_SPAN


def _read_nodefile(path: str) -> tuple[str, ...]:
    """Unique hosts of a PBS node file, in order (the file repeats a host once per slot)."""
    try:
        with open(path) as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError as err:
        raise DiscoveryError(f"PBS_NODEFILE={path!r} cannot be read: {err}") from None
    return tuple(dict.fromkeys(lines))


def _short(host: str) -> str:
    return host.split(".")[0]


def _node_index(nodes: tuple[str, ...]) -> int | None:
    """Index of this machine in the node list, or None when it is not there."""
    me = {_short(socket.gethostname()), _short(socket.getfqdn())}
    for index, host in enumerate(nodes):
        if _short(host) in me:
            return index
    return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise DiscoveryError(message)


@dataclass
class _Raw:
    """What one launcher told us, before defaults and checks."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    node_rank: int | None
    num_nodes: int | None
    nodes: tuple[str, ...]
    names: dict[str, str]  # field -> the variable it came from, for error messages
    job_id: str | None


def _from_rank_variables(env: Mapping[str, str]) -> _Raw:
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        _check(env.get(name, "") != "", f"RANK is set but {name} is not: set RANK, WORLD_SIZE and LOCAL_RANK together")
    local = _first_int(env, "LOCAL_WORLD_SIZE")
    node = _first_int(env, "GROUP_RANK", "NODE_RANK")
    return _Raw(
        "env", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
        local[1] if local else None, node[1] if node else None, None, (),
        {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
         "local_world_size": local[0] if local else "LOCAL_WORLD_SIZE", "node_rank": node[0] if node else "GROUP_RANK"},
        env.get("TORCHELASTIC_RUN_ID") or None,
    )


def _from_slurm(env: Mapping[str, str]) -> _Raw:
    nodelist_var = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)),
                        None)
    try:
        nodes = tuple(expand_hostlist(env[nodelist_var])) if nodelist_var else ()
        per_node_var = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), None)
        per_node = parse_tasks_per_node(env[per_node_var]) if per_node_var else []
    except HostlistError as err:
        raise DiscoveryError(f"Slurm variable: {err}") from None
    world_var, world = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or ("SLURM_NTASKS", 1)
    nnodes = _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node_rank = _first_int(env, "SLURM_NODEID")
    local_size = None
    names = {"rank": "SLURM_PROCID", "world_size": world_var, "local_rank": "SLURM_LOCALID",
             "node_rank": "SLURM_NODEID",
             "num_nodes": nnodes[0] if nnodes else "SLURM_NNODES", "nodes": nodelist_var or "SLURM_JOB_NODELIST",
             "local_world_size": "SLURM_STEP_TASKS_PER_NODE"}
    if per_node:
        _check(sum(per_node) == world,
               f"{per_node_var}={env[per_node_var]!r} sums to {sum(per_node)} tasks but {world_var}={world}")
        if nnodes:
            _check(len(per_node) == nnodes[1],
                   f"{per_node_var}={env[per_node_var]!r} lists {len(per_node)} nodes but {nnodes[0]}={nnodes[1]}")
        index = node_rank[1] if node_rank else 0
        _check(0 <= index < len(per_node), f"SLURM_NODEID={index} is outside {per_node_var}={env[per_node_var]!r}")
        local_size = per_node[index]
        names["local_world_size"] = per_node_var
    local = _first_int(env, "SLURM_LOCALID")
    return _Raw("slurm", _int(env, "SLURM_PROCID"), world, local[1] if local else 0,
                local_size, node_rank[1] if node_rank else None, nnodes[1] if nnodes else None, nodes, names,
                env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None)


def _from_pals(env: Mapping[str, str]) -> _Raw:
    rank_var = "PALS_RANKID" if env.get("PALS_RANKID") else "PMI_RANK"
    local_var = "PALS_LOCAL_RANKID" if env.get("PALS_LOCAL_RANKID") else "PMI_LOCAL_RANK"
    _check(env.get("PMI_SIZE", "") != "", f"{rank_var} is set but PMI_SIZE is not: cannot tell the world size")
    _check(env.get(local_var, "") != "", f"{rank_var} is set but {local_var} is not: cannot tell the local rank")
    nodes = _read_nodefile(env["PBS_NODEFILE"]) if env.get("PBS_NODEFILE") else ()
    local = _first_int(env, "PMI_LOCAL_SIZE")
    node = _first_int(env, "PALS_NODEID")
    return _Raw("pals", _int(env, rank_var), _int(env, "PMI_SIZE"), _int(env, local_var), local[1] if local else None,
                node[1] if node else None, len(nodes) or None, nodes,
                {"rank": rank_var, "world_size": "PMI_SIZE", "local_rank": local_var,
                 "local_world_size": "PMI_LOCAL_SIZE",
                 "node_rank": "PALS_NODEID", "num_nodes": "PBS_NODEFILE", "nodes": "PBS_NODEFILE"},
                env.get("PBS_JOBID") or None)


def _from_generic(source: str, env: Mapping[str, str], rank: str, size: str, local: str, local_size: str,
                  nnodes: str | None = None, job: str | None = None) -> _Raw:
    for name in (size, local):
        _check(env.get(name, "") != "", f"{rank} is set but {name} is not ({source})")
    lsize = _first_int(env, local_size)
    num = _first_int(env, nnodes) if nnodes else None
    nodes: tuple[str, ...] = ()
    if env.get("PBS_NODEFILE"):  # mpiexec inside a PBS job
        nodes = _read_nodefile(env["PBS_NODEFILE"])
    elif env.get("SLURM_JOB_NODELIST"):  # mpirun inside a Slurm allocation
        nodes = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
    return _Raw(source, _int(env, rank), _int(env, size), _int(env, local), lsize[1] if lsize else None, None,
                num[1] if num else None, nodes,
                {"rank": rank, "world_size": size, "local_rank": local, "local_world_size": local_size,
                 "num_nodes": nnodes or local_size, "node_rank": rank},
                (env.get(job) if job else None) or env.get("PBS_JOBID") or env.get("SLURM_JOB_ID") or None)


def _from_pmix(env: Mapping[str, str]) -> _Raw:
    size_var = next((n for n in ("PMIX_SIZE", "WORLD_SIZE", "PMI_SIZE") if env.get(n)), None)
    _check(size_var is not None, "PMIX_RANK is set but no world size variable (PMIX_SIZE, WORLD_SIZE or PMI_SIZE) is")
    lsize = _first_int(env, "PMIX_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
    lrank = _first_int(env, "PMIX_LOCAL_RANK", "LOCAL_RANK")
    rank, size = _int(env, "PMIX_RANK"), _int(env, size_var)
    return _Raw("pmix", rank, size, lrank[1] if lrank else (rank if not lsize else rank % lsize[1]),
                lsize[1] if lsize else None, None, None, (),
                {"rank": "PMIX_RANK", "world_size": size_var, "local_rank": lrank[0] if lrank else "PMIX_LOCAL_RANK",
                 "local_world_size": lsize[0] if lsize else "PMIX_LOCAL_SIZE", "node_rank": "PMIX_RANK"},
                env.get("PMIX_NAMESPACE") or None)


# An MPI launcher's rank and world-size variables, to compare with Slurm's when both are set
MPI_RANK_AND_SIZE = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                     ("PMIX_RANK", "PMIX_SIZE"), ("PALS_RANKID", "PMI_SIZE"))


def _mpi_launched_inside_slurm(env: Mapping[str, str]) -> bool:
    """mpirun/mpiexec inside a Slurm allocation starts its daemons with srun, one per node, and its ranks inherit
    that step's SLURM_* variables: then the MPI launcher's rank or world size differs from Slurm's, and it is the
    one that started this process. srun's own MPI plugins (PMIx, PMI2) agree with Slurm."""
    slurm_world = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    for rank, size in MPI_RANK_AND_SIZE:
        if env.get(rank, "") != "" and env.get(size, "") != "":
            if _int(env, rank) != _int(env, "SLURM_PROCID") or (slurm_world and _int(env, size) != slurm_world[1]):
                return True
    return False


CONTAINER_LIMIT = ("Slurm gave this task none of its task variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID), as "
                   "Slurm 22.05's OCI containers (srun --container) do")
CONTAINER_WAY_OUT = ("run the image under srun with apptainer or pyxis, or on a Slurm whose OCI containers pass the "
                     "task variables (24.11 does), or set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR yourself")


_FIELDS = ("rank", "world_size", "local_rank", "local_world_size", "node_rank", "num_nodes", "nodes")


def _descends_from(pid: int) -> bool:
    """True when `pid` is this process or one of its ancestors (/proc's parent chain)."""
    current = os.getpid()
    while current > 0:
        if current == pid:
            return True
        try:
            current = int(Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _hidden_slurm_task(env: Mapping[str, str]) -> str | None:
    """How a Slurm job shows itself without this task's variables: "step" (the step's variables only: a container
    step started by srun outside a batch script), "job" (the batch script's variables, yet this process does not
    descend from the batch shell SLURM_TASK_PID names: a container step inside a batch script), or None."""
    if env.get("SLURM_PROCID", "") == "" and env.get("SLURM_STEP_ID", "") != "":
        return "step"
    task_pid = env.get("SLURM_TASK_PID", "")
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID", "") == "" and task_pid.isdigit():
        return None if _descends_from(int(task_pid)) else "job"
    return None


def _from_hidden_slurm_task(env: Mapping[str, str], shows: str) -> _Raw:
    """Place a task whose step hides the task variables: possible when the step runs one task per node (22.05's
    container steps always do) and its node list names this host; the rank is then the host's index in that list."""
    job_id = env.get("SLURM_JOB_ID") or None
    if shows == "job":  # only the job's variables: the step's own node and task counts are unknown
        nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""))
        _check(len(nodes) == 1, f"{CONTAINER_LIMIT}, nor the step's (SLURM_STEP_ID, SLURM_STEP_NODELIST): this job "
                                f"has {len(nodes)} nodes (SLURM_JOB_NODELIST), so this task's rank cannot be known: "
                                f"{CONTAINER_WAY_OUT}")
        return _Raw("slurm", 0, 1, 0, 1, 0, 1, nodes, dict.fromkeys(_FIELDS, "SLURM_JOB_NODELIST"), job_id)
    nodes_var = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(n)), "SLURM_STEP_NODELIST")
    nodes = tuple(expand_hostlist(env.get(nodes_var, "")))
    tasks_var, tasks = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or ("SLURM_STEP_NUM_TASKS", 0)
    _check(tasks == len(nodes) > 0,
           f"{CONTAINER_LIMIT}: {tasks_var}={tasks} tasks on {len(nodes)} nodes ({nodes_var}), so this task's rank "
           f"cannot be known: {CONTAINER_WAY_OUT}; or run one task per node (srun --ntasks-per-node=1 ... "
           "entrypoint launch --nproc-per-node G)")
    index = _node_index(nodes)
    _check(index is not None, f"{CONTAINER_LIMIT}, and this host ({socket.gethostname()}) is not in {nodes_var}="
                              f"{env[nodes_var]!r} (a container with a host name of its own?), so its rank cannot be "
                              f"known: {CONTAINER_WAY_OUT}")
    return _Raw("slurm", index, tasks, 0, 1, index, len(nodes), nodes,
                {**dict.fromkeys(_FIELDS, nodes_var), "world_size": tasks_var}, job_id)


def _raw(env: Mapping[str, str]) -> _Raw | None:
    if env.get("RANK", "") != "":
        return _from_rank_variables(env)
    if (env.get("SLURM_PROCID", "") != "" and env.get("SLURM_STEP_ID", "") != ""
            and not _mpi_launched_inside_slurm(env)):
        return _from_slurm(env)
    if env.get("PALS_RANKID", "") != "" or (env.get("PMI_RANK", "") != "" and env.get("PMI_LOCAL_RANK", "") != ""):
        return _from_pals(env)
    if env.get("OMPI_COMM_WORLD_RANK", "") != "":
        return _from_generic("openmpi", env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if env.get("PMI_RANK", "") != "":
        return _from_generic("mpich", env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if env.get("PMIX_RANK", "") != "":
        return _from_pmix(env)
    if env.get("FLUX_TASK_RANK", "") != "":
        return _from_generic("flux", env, "FLUX_TASK_RANK", "FLUX_JOB_SIZE", "FLUX_TASK_LOCAL_ID",
                             "FLUX_TASK_LOCAL_SIZE",
                             nnodes="FLUX_JOB_NNODES", job="FLUX_JOB_ID")
    hidden = _hidden_slurm_task(env)
    if hidden is not None:
        try:
            return _from_hidden_slurm_task(env, hidden)
        except HostlistError as err:
            raise DiscoveryError(f"Slurm variable: {err}") from None
    return None


def discover(env: Mapping[str, str] = os.environ) -> RankInfo:
    """This process's place in the job, from the first launcher whose variables are present."""
    raw = _raw(env)
    if raw is None:
        host = socket.gethostname()
        return RankInfo(0, 1, 0, 1, 0, 1, (host,), env.get("MASTER_ADDR") or "127.0.0.1",
                        _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT, "none")
    n = raw.names
    _check(raw.world_size >= 1, f"{n['world_size']}={raw.world_size} must be >= 1")
    _check(0 <= raw.rank < raw.world_size, f"{n['rank']}={raw.rank} is not below {n['world_size']}={raw.world_size}")

    num_nodes = raw.num_nodes or (len(raw.nodes) if raw.nodes else None)
    if raw.nodes and raw.num_nodes:
        _check(len(raw.nodes) == raw.num_nodes,
               f"{n.get('nodes', 'node list')} names {len(raw.nodes)} hosts but {n.get('num_nodes')}={raw.num_nodes}")
    local_size = raw.local_world_size
    if local_size is None:
        if num_nodes:
            _check(raw.world_size % num_nodes == 0,
                   f"{n['world_size']}={raw.world_size} is not a multiple of the {num_nodes} nodes "
                   f"({n.get('num_nodes')}); set {n['local_world_size']}")
            local_size = raw.world_size // num_nodes
        else:
            local_size = raw.world_size
    _check(local_size >= 1, f"{n['local_world_size']}={local_size} must be >= 1")
    _check(0 <= raw.local_rank < local_size,
           f"{n['local_rank']}={raw.local_rank} is not below {n['local_world_size']}={local_size}")
    if num_nodes is None:
        _check(raw.world_size % local_size == 0,
               f"{n['local_world_size']}={local_size} does not divide {n['world_size']}={raw.world_size}")
        num_nodes = raw.world_size // local_size
    elif raw.source != "slurm":  # Slurm may place unequal task counts per node; it was checked above
        _check(local_size * num_nodes == raw.world_size,
               f"{n['local_world_size']}={local_size} x {num_nodes} nodes ({n.get('num_nodes')}) "
               f"!= {n['world_size']}={raw.world_size}")
    node_rank = raw.node_rank
    if node_rank is None:
        node_rank = (_node_index(raw.nodes) if raw.nodes else None)
        if node_rank is None:
            node_rank = raw.rank // local_size
    _check(0 <= node_rank < num_nodes, f"{n['node_rank']}={node_rank} is not below the {num_nodes} nodes")

    if env.get("MASTER_ADDR"):
        master = env["MASTER_ADDR"]
    elif raw.nodes:
        master = raw.nodes[0]
    elif num_nodes == 1:
        master = "127.0.0.1"
    else:
        raise DiscoveryError(f"{raw.source}: {num_nodes} nodes but no node list to take the master from: "
                             "set MASTER_ADDR")
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else job_port(raw.job_id)
    return RankInfo(raw.rank, raw.world_size, raw.local_rank, local_size, node_rank, num_nodes,
                    raw.nodes or ((socket.gethostname(),) if num_nodes == 1 else ()), master, port,
                    raw.source, raw.job_id)


def as_spawned(info: RankInfo, local_rank: int, nproc: int) -> RankInfo:
    """The RankInfo of local rank `local_rank` spawned by a one-task-per-node supervisor."""
    return replace(info, rank=info.node_rank * nproc + local_rank, world_size=info.num_nodes * nproc,
                   local_rank=local_rank, local_world_size=nproc)


def rank_env(info: RankInfo) -> dict[str, str]:
    """The torch.distributed env:// variables of one rank."""
    return {
        "RANK": str(info.rank), "WORLD_SIZE": str(info.world_size), "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size), "GROUP_RANK": str(info.node_rank),
        "NODE_RANK": str(info.node_rank), "NNODES": str(info.num_nodes),
        "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port),
    }
