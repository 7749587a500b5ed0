"""`entrypoint env`: what `launch`/`train` would decide here, and why, without starting anything.

`--format shell` prints `export` lines (with the reason as a comment) that `eval "$(entrypoint env)"`
accepts; `--format json` prints the whole plan for tools.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from megatron_ds.env_settings import PROFILE
from megatron_ds.runtime import bootstrap, profiles
from megatron_ds.runtime.discovery import DiscoveryError, rank_env
from megatron_ds.runtime.launch_cli import add_launch_flags, apply_overrides
from megatron_ds.runtime.profiles import ProfileError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="entrypoint env",
        description="Print the rank, world, nodes, master, device, CPU set and every variable that "
                    "`entrypoint launch`/`train` would set here, each with the reason. Starts nothing.")
    add_launch_flags(parser)
    parser.add_argument("--format", choices=("shell", "json"), default="shell", help="output format (default shell)")
    parser.add_argument("--list-profiles", action="store_true", help="list the known site profiles and exit")
    return parser


def _rank_source(plan: bootstrap.Plan) -> str:
    if plan.spawn:
        return f"spawned by this process: node_rank {plan.info.node_rank} x {plan.nproc} + local rank"
    return f"discovered from {plan.info.source}"


def describe_plan(plan: bootstrap.Plan, env: dict[str, str]) -> dict:
    """The plan as plain data: ranks, profile, variables with reasons, library checks."""
    settings = profiles.apply(plan.profile, env)
    gpus = bootstrap.visible_gpus(env)
    platform = "cuda" if plan.profile.platform == "cuda" else "rocm"
    ranks = []
    for info in plan.ranks():
        cpus, cpu_why = profiles.cpus_for(plan.profile, info.local_rank, env)
        ranks.append({
            "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
            "local_world_size": info.local_world_size, "node_rank": info.node_rank,
            "device": f"{platform}:{info.local_rank % gpus}" if gpus else "cpu",
            "cpus": profiles.format_cpus(cpus) if cpus else profiles.format_cpus(os.sched_getaffinity(0)),
            "cpus_why": cpu_why if cpus else f"inherited ({cpu_why})",
        })
    variables = [{"name": k, "value": v, "why": _rank_source(plan)} for k, v in rank_env(plan.ranks()[0]).items()]
    if plan.hosts_store and not plan.info.master_port:
        port = next(v for v in variables if v["name"] == "MASTER_PORT")
        port["why"] = "the launcher serves the rendezvous on a port the OS assigns when the ranks start (0 here; set " \
                      "MASTER_PORT to choose one)"
    variables += [{"name": s.name, "value": s.value, "why": s.why} for s in settings]
    variables.append({"name": PROFILE.name, "value": plan.profile.name, "why": f"profile chosen ({plan.profile_why})"})
    return {
        "source": plan.info.source, "mode": "spawn" if plan.spawn else "rank",
        "nproc_per_node": plan.nproc, "nproc_why": plan.nproc_why,
        "nodes": list(plan.info.nodes), "num_nodes": plan.info.num_nodes, "node_rank": plan.info.node_rank,
        "master_addr": plan.info.master_addr, "master_port": plan.info.master_port, "job_id": plan.info.job_id,
        "profile": {"name": plan.profile.name, "why": plan.profile_why, "file": plan.profile.path,
                    "description": plan.profile.description},
        "ranks": ranks, "variables": variables,
        "libraries": [{"role": c.role, "candidates": list(c.candidates), "loaded": c.loaded, "errors": list(c.errors)}
                      for c in profiles.check_libraries(plan.profile, env)],
    }


def _shell(report: dict) -> str:
    lines = [f"# mds: {report['source']}, mode {report['mode']} ({report['nproc_why']}), "
             f"nodes {report['num_nodes']} {','.join(report['nodes'][:8])}{'...' if len(report['nodes']) > 8 else ''}",
             f"# profile {report['profile']['name']} ({report['profile']['why']}): {report['profile']['file']}"]
    for rank in report["ranks"]:
        lines.append(f"# rank {rank['rank']}/{rank['world_size']} local {rank['local_rank']}/{rank['local_world_size']}"
                     f" device {rank['device']} cpus {rank['cpus']} ({rank['cpus_why']})")
    for lib in report["libraries"]:
        state = f"loads ({lib['loaded']})" if lib["loaded"] else "MISSING: " + "; ".join(lib["errors"])[:200]
        lines.append(f"# {lib['role']}: {state}")
    if report["mode"] == "spawn":
        lines.append("# the rank variables below are those of local rank 0; each spawned rank gets its own")
    for var in report["variables"]:
        lines.append(f"export {var['name']}={shlex.quote(var['value'])}  # {var['why']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list_profiles:
            for name, profile in sorted(profiles.all_profiles().items()):
                print(f"{name:<14} {profile.platform:<5} {profile.description}")
            return 0
        apply_overrides(args)
        plan = bootstrap.make_plan(args.nproc_per_node, args.profile)
        report = describe_plan(plan, dict(os.environ))
    except (DiscoveryError, ProfileError) as err:
        print(f"entrypoint env: {err}", file=sys.stderr)
        return bootstrap.USAGE_ERROR
    print(json.dumps(report, indent=2) if args.format == "json" else _shell(report))
    return 0
