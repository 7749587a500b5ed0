"""`entrypoint launch [options] -- CMD ...`: run any command as the ranks of this job.

Under a scheduler that starts one task per GPU, the variables are mapped and CMD is exec'd (signals
and exit codes stay the scheduler's). Alone on a node, --nproc-per-node copies of CMD are spawned
and supervised. `entrypoint train` uses the same machinery (runtime.bootstrap).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ds.runtime import bootstrap
from megatron_ds.runtime.discovery import DiscoveryError
from megatron_ds.runtime.profiles import ProfileError


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by `launch` and `env`."""
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="ranks to spawn when this task is alone on its node "
                             "(default: the GPUs visible; 1 without)")
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="site profile (default: $MDS_PROFILE, else detected); `entrypoint env --list-profiles`")
    parser.add_argument("--master-addr", default=None,
                        help="overrides MASTER_ADDR (default: the first host of the job)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="overrides MASTER_PORT (default: derived from the job id; without a launcher, the "
                             "port of the rendezvous store this process serves)")


def apply_overrides(args: argparse.Namespace) -> None:
    """--master-addr/--master-port into the environment, where discovery reads them (`launch`, `env`, `train`)."""
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise DiscoveryError(f"--master-port: must be a TCP port (1-65535), got {args.master_port}")
    if args.master_addr:
        os.environ["MASTER_ADDR"] = args.master_addr
    if args.master_port:
        os.environ["MASTER_PORT"] = str(args.master_port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="entrypoint launch",
        description="Run CMD as the ranks of this job: finds rank/world/master from torchrun, Slurm, PALS/PMI, "
                    "Open MPI, MPICH, PMIx or Flux variables, applies the site profile, and either execs CMD "
                    "(one task per GPU) or spawns and supervises --nproc-per-node copies (one task per node).",
        epilog="examples:\n"
               "  entrypoint launch --nproc-per-node 2 -- python -c 'import os; print(os.environ[\"RANK\"])'\n"
               "  srun -N2 --ntasks-per-node=1 entrypoint launch --label -- python train.py\n\n"
               "exit codes: the first failed rank's (killed by signal N: 128+N); 124 when the ranks hung (no progress\n"
               "within the watchdog's allowance: stacks dumped, stuck rank named); "
               "2 for inconsistent launcher variables",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_flags(parser)
    parser.add_argument("--strict", action="store_true",
                        help="fail (exit 2) when the profile's network plugin cannot be loaded, instead of warning")
    parser.add_argument("--label", action="store_true", help="prefix each output line of a spawned rank with [rankN]")
    parser.add_argument("--tee", default=None, metavar="DIR",
                        help="also write each spawned rank's output to DIR/rankN.log")
    parser.add_argument("--grace", type=float, default=5.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="run the spawned ranks again up to N times after a failure or a hang (default 0)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: use `entrypoint launch [options] -- CMD ...`")
    try:
        apply_overrides(args)
        plan = bootstrap.make_plan(args.nproc_per_node, args.profile, max_restarts=args.max_restarts)
        if plan.spawn:
            return bootstrap.spawn_ranks(plan, command, strict=args.strict, grace=args.grace, label=args.label,
                                         tee_dir=args.tee, max_restarts=args.max_restarts)
        bootstrap.enter_rank(plan, strict=args.strict)
    except (DiscoveryError, ProfileError) as err:
        print(f"entrypoint launch: {err}", file=sys.stderr)
        return bootstrap.USAGE_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)  # the scheduler keeps our pid: its signals and exit code are the rank's
    except OSError as err:
        print(f"entrypoint launch: cannot run {command[0]!r}: {err}", file=sys.stderr)
        return 127
