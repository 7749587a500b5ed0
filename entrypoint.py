"""The single mds command: `entrypoint <command> [flags]`.

Each command lives in the package that owns its concern and exposes `main(argv) -> int`;
this file only dispatches, so `entrypoint train` inside a spawned rank costs one import.
A command appears here only once it works.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

_STARTED_AT = time.time()  # what the user waits from: the ranks' start-up lines count from here

# name -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_ds.training.cli",
              "pretrain a GPT (Megatron-DeepSpeed pretrain_gpt.py flags; TP/SP/PP/DP, ZeRO)"),
    "doctor": ("megatron_ds.runtime.doctor",
               "check the software stack (torch, CUDA/ROCm, NCCL, DeepSpeed, TE, flash-attn, ...) "
               "and the site profile"),
    "env": ("megatron_ds.runtime.env_cli",
            "show rank, world, master, device, CPU set and every variable launch would set, and why"),
    "sbatch": ("megatron_ds.runtime.sbatch",
               "write a Slurm (pyxis, apptainer, host) or PBS job script that runs an entrypoint command"),
    "preprocess": ("megatron_ds.data.preprocess",
                   "tokenize JSON lines into Megatron indexed datasets (tools/preprocess_data.py flags)"),
    "launch": ("megatron_ds.runtime.launch_cli",
               "run any command as the ranks of this job (spawn + supervise, or map + exec)"),
    "convert": ("megatron_ds.convert.cli",
                "export a checkpoint as a Hugging Face model (TP/PP shards merged), "
                "or import one (--from hf) at a chosen TP/PP"),
}


def usage() -> str:
    width = max((len(name) for name in COMMANDS), default=0)
    lines = ["usage: entrypoint <command> [flags]   (entrypoint <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a usage error, like any command without its required arguments
        print(f"entrypoint: no command given\n\n{usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "--version":
        from megatron_ds import __version__

        print(f"mds {__version__}")
        return 0
    if name not in COMMANDS:
        print(f"entrypoint: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from megatron_ds.env_settings import STARTED_AT

    os.environ.setdefault(STARTED_AT.name, repr(_STARTED_AT))  # a spawned rank keeps its launcher's
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
