"""Turn this process into a rank, or into the supervisor of this node's ranks.

Policy (DESIGN.md "Two launch modes"): a process started by torchrun is a rank. Under a scheduler,
a task that is one of several on its node is a rank (variables mapped, run in-process or exec'd);
a task that is alone on its node spawns --nproc-per-node ranks (default: the GPUs it sees) when
that is more than one. Without any launcher the same holds with one process on one machine.
Spawned ranks get RANK = node_rank * nproc + local_rank and WORLD_SIZE = nodes * nproc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from megatron_ds.env_settings import RANK_LD_PRELOAD, SPAWNED_AT, STARTED_AT, SUPERVISED
from megatron_ds.runtime import profiles
from megatron_ds.runtime.discovery import DiscoveryError, RankInfo, as_spawned, discover, rank_env
from megatron_ds.runtime.profiles import Profile, ProfileError
from megatron_ds.runtime.rendezvous import hosted_store
from megatron_ds.runtime.restarts import Failure, RestartPolicy
from megatron_ds.runtime.supervisor import RankSpec, Supervisor

USAGE_ERROR = 2


def visible_gpus(env: Mapping[str, str] = os.environ, root: str = "/") -> int:
    """GPUs this process may use, without importing torch (which costs seconds per rank)."""
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        value = env.get(name)
        if value is not None:
            return len([d for d in value.split(",") if d.strip() and d.strip() != "-1"])
    # Device nodes first: a container holds only the GPUs it was given, /proc may list the host's.
    nvidia = (glob.glob(os.path.join(root, "dev/nvidia[0-9]*"))
              or glob.glob(os.path.join(root, "proc/driver/nvidia/gpus/*")))
    if nvidia:
        return len(nvidia)
    amd = 0  # kfd topology: CPU nodes have simd_count 0
    for props in glob.glob(os.path.join(root, "sys/class/kfd/kfd/topology/nodes/*/properties")):
        try:
            with open(props) as handle:
                amd += any(line.split()[:1] == ["simd_count"] and line.split()[1] != "0" for line in handle)
        except OSError:
            continue
    return amd


@dataclass(frozen=True)
class Plan:
    """What this process will do, decided before anything is started."""

    info: RankInfo
    spawn: bool
    nproc: int
    nproc_why: str
    profile: Profile
    profile_why: str
    hosts_store: bool = False  # this process serves the ranks' rendezvous store (runtime/rendezvous.py)

    def ranks(self) -> list[RankInfo]:
        """The RankInfo of each rank this process becomes or spawns."""
        if not self.spawn:
            return [self.info]
        return [as_spawned(self.info, local, self.nproc) for local in range(self.nproc)]


def make_plan(nproc_per_node: int | None = None, profile: str | None = None,
              env: Mapping[str, str] = os.environ, *, max_restarts: int = 0) -> Plan:
    """Discover, choose the profile and the launch mode. Raises DiscoveryError / ProfileError.

    With max_restarts a single rank is spawned too, so that a supervisor is there to restart it. Where another
    launcher owns the rank processes (torchrun, one scheduler task per rank) --nproc-per-node and --max-restarts
    cannot apply: rank 0 says so instead of dropping them silently."""
    info = discover(env)
    chosen, profile_why = profiles.choose(profile, env)
    if nproc_per_node is not None and nproc_per_node < 1:
        raise DiscoveryError(f"--nproc-per-node={nproc_per_node} must be >= 1")
    gpus = visible_gpus(env)
    if nproc_per_node is not None:
        nproc, why = nproc_per_node, "--nproc-per-node"
    elif gpus:
        nproc, why = gpus, f"{gpus} visible GPU(s)"
    else:
        nproc, why = 1, "no GPU visible"
    if info.source == "env":
        if not SUPERVISED.get(env) and info.rank == 0:  # our own spawned ranks inherit both flags
            ignored = [flag for flag, given in (("--nproc-per-node", nproc_per_node is not None),
                                                ("--max-restarts", max_restarts > 0)) if given]
            if ignored:
                _warn(f"{' and '.join(ignored)} ignored: RANK is set, so another launcher (torchrun?) started this "
                      f"rank and owns its processes; give that launcher the option (torchrun has both)")
        return Plan(info, False, 1, "RANK is set: this process is one rank", chosen, profile_why)
    if info.local_world_size > 1:
        if nproc_per_node is not None and nproc_per_node != info.local_world_size:
            _warn(f"--nproc-per-node {nproc_per_node} ignored: {info.source} already runs {info.local_world_size} "
                  f"tasks on this node, each one rank")
        if max_restarts > 0 and info.rank == 0:
            _warn(f"--max-restarts {max_restarts} ignored: {info.source} runs one task per rank and owns them; "
                  f"restart the job with it (Slurm: #SBATCH --requeue, see the README's Restarts), or run one task "
                  f"per node and let mds start the node's ranks")
        return Plan(info, False, 1, f"{info.source} runs {info.local_world_size} tasks on this node: one rank each",
                    chosen, profile_why)
    if info.source == "none" and env.get("SLURM_JOB_ID") and int(env.get("SLURM_JOB_NUM_NODES") or 1) > 1:
        _warn("inside a Slurm batch script but not in an srun step: only this node runs; start ranks with srun")
    spawn = nproc > 1 or max_restarts > 0
    if nproc == 1 and spawn:
        why += f"; started as a supervised child for --max-restarts {max_restarts}"
    hosts_store = spawn and info.source == "none"  # one machine, and all its ranks ours
    if hosts_store and not env.get("MASTER_PORT"):
        info = dataclasses.replace(info, master_port=0)  # 0 until the store is bound: the OS assigns it then
    return Plan(info, spawn, nproc, why, chosen, profile_why, hosts_store)


def _warn(message: str) -> None:
    print(f"mds: WARNING: {message}", file=sys.stderr, flush=True)


def prepare_env(plan: Plan, env: dict[str, str], *, strict: bool = False) -> list[profiles.Setting]:
    """Apply the profile to `env` and check its libraries; with strict a missing plugin is an error."""
    decided = profiles.apply(plan.profile, env)
    for check in profiles.check_libraries(plan.profile, env):
        if check.loaded is None:
            message = (f"profile {plan.profile.name} needs {check.role} ({' or '.join(check.candidates)}) but none "
                       f"can be loaded ({'; '.join(check.errors)[:300]}); collectives will fall back to slow TCP "
                       f"sockets. Add its directory to LD_LIBRARY_PATH.")
            if strict:
                raise ProfileError(message)
            _warn(message)
    return decided


def describe(plan: Plan) -> str:
    i = plan.info
    mode = f"spawning {plan.nproc} local rank(s) ({plan.nproc_why})" if plan.spawn else f"one rank ({plan.nproc_why})"
    return (f"{i.source}: node {i.node_rank}/{i.num_nodes}, {mode}, world {plan.ranks()[0].world_size}, "
            f"master {i.master_addr}:{i.master_port}, profile {plan.profile.name} ({plan.profile_why})")


def bind_cpus(plan: Plan, local_rank: int, env: Mapping[str, str]) -> tuple[int, ...] | None:
    cpus, why = profiles.cpus_for(plan.profile, local_rank, env)
    if cpus is None and plan.profile.cpus_by_local_rank:
        _warn(f"CPU binding skipped: {why}")
    return cpus


def rank_ld_preload(env: Mapping[str, str]) -> str | None:
    """LD_PRELOAD for rank processes: MDS_RANK_LD_PRELOAD first (e.g. the MS-AMP image's libmsamp_dist.so
    and its NCCL), then whatever the user preloads. Only ranks get it: the launcher, builds and shells
    must not load MS-AMP's NCCL interposer."""
    extra = list(RANK_LD_PRELOAD.get(env))
    if not extra:
        return None
    user = [lib for lib in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if lib and lib not in extra]
    return ":".join(extra + user)


def rank_specs(plan: Plan, argv: list[str], base_env: dict[str, str]) -> list[RankSpec]:
    specs = []
    for info in plan.ranks():
        env = dict(base_env)
        env.update(rank_env(info))
        preload = rank_ld_preload(env)
        if preload:
            env["LD_PRELOAD"] = preload
        specs.append(RankSpec(info.rank, info.local_rank, list(argv), env, bind_cpus(plan, info.local_rank, env)))
    return specs


def enter_rank(plan: Plan, *, strict: bool = False) -> None:
    """Make this process the plan's rank: profile variables, rank variables, CPU binding."""
    prepare_env(plan, os.environ, strict=strict)
    os.environ.update(rank_env(plan.info))
    preload = rank_ld_preload(os.environ)
    if preload:
        os.environ["LD_PRELOAD"] = preload  # for the exec'd command (entrypoint launch)
    cpus = bind_cpus(plan, plan.info.local_rank, os.environ)
    if cpus:
        os.sched_setaffinity(0, cpus)


def spawn_ranks(plan: Plan, argv: list[str], *, strict: bool = False, grace: float = 5.0,
                signal_grace: float | None = None, label: bool = False,
                tee_dir: str | None = None, max_restarts: int = 0) -> int:
    """Run `argv` as each local rank of the plan, supervised (hang watchdog included), restarted after a
    failure up to `max_restarts` times; returns the launcher's exit code."""
    base = dict(os.environ)
    prepare_env(plan, base, strict=strict)
    base[SUPERVISED.name] = "1"  # their launcher flags were ours to apply
    policy = RestartPolicy(max_restarts)
    attempt, store_port = 0, plan.info.master_port  # with hosts_store, 0: the OS picks one for each attempt
    while True:
        with contextlib.ExitStack() as attempt_scope:
            env = dict(base)
            if plan.hosts_store:
                store = attempt_scope.enter_context(hosted_store(store_port, attempt))
                plan = dataclasses.replace(plan, info=dataclasses.replace(plan.info, master_port=store.port))
                env.update(store.rank_env)
            if attempt == 0:
                print(f"mds: {describe(plan)}", file=sys.stderr, flush=True)
            env[SPAWNED_AT.name] = repr(time.time())  # the ranks' start-up line splits the launcher's part off
            # progress records and stacks of this attempt; kept (and named in the log) when it fails
            watch_dir = tempfile.mkdtemp(prefix="mds-watchdog-")
            supervisor = Supervisor(rank_specs(plan, argv, env), grace=grace, signal_grace=signal_grace,
                                    label=label, tee_dir=tee_dir, watch_dir=watch_dir)
            code = supervisor.run()
        rank = supervisor.failure[0].rank if supervisor.failure else None
        failure = Failure(code, rank, supervisor.watchdog.last_iteration())
        if supervisor.hang is None:  # only a hang's stacks are worth keeping
            shutil.rmtree(watch_dir, ignore_errors=True)
        if code == 0:
            return 0
        if not policy.should_restart(failure, stopped_from_outside=bool(supervisor.received)):
            return code
        base[STARTED_AT.name] = repr(time.time())  # the next ranks' start-up counts from their relaunch
        attempt += 1


def become_rank(child_argv: list[str], *, nproc_per_node: int | None = None, profile: str | None = None,
                signal_grace: float | None = None, plan: Plan | None = None, max_restarts: int = 0) -> int | None:
    """Called by `entrypoint train` after its config validated.

    Returns None when this process is a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT set in os.environ, profile applied, CPUs bound); otherwise spawns
    `entrypoint <child_argv>` per local rank, supervises them and returns the exit code
    (2 when the launcher's variables or the profile are inconsistent; 124 when the ranks hung), running
    them again up to `max_restarts` times after a failure. `entrypoint launch`'s
    --strict, --label, --tee and --grace go through spawn_ranks / enter_rank directly.
    """
    try:
        plan = plan or make_plan(nproc_per_node, profile, max_restarts=max_restarts)
        if plan.spawn:
            argv = [sys.executable, "-m", "entrypoint", *child_argv]
            return spawn_ranks(plan, argv, signal_grace=signal_grace, max_restarts=max_restarts)
        preloaded = os.environ.get("LD_PRELOAD")
        enter_rank(plan)
        if os.environ.get("LD_PRELOAD") != preloaded:
            # a preload only takes effect at process start: run this rank again, now with it
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, "-m", "entrypoint", *child_argv])
    except (DiscoveryError, ProfileError) as err:
        print(f"entrypoint: {err}", file=sys.stderr)
        return USAGE_ERROR
    if plan.info.rank == 0:
        print(f"mds: {describe(plan)}", file=sys.stderr, flush=True)
    return None


def leave_rank(code: int) -> NoReturn:
    """End a rank whose work is done and flushed, skipping the interpreter's teardown.

    Gloo's C++ worker threads live as long as their process group, and DeepSpeed keeps references
    to the groups, so they outlive destroy_process_group(). If one of them drops a tensor while the
    interpreter is finalizing, it must take the GIL, Python ends that thread with pthread_exit, and
    the forced unwind through a noexcept destructor aborts the process ("terminate called without
    an active exception", exit 134) after a run that succeeded: seen in CI, 2 of one suite run's
    multi-rank trainings, at random.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
