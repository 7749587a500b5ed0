"""`entrypoint convert --to hf --load DIR --output OUT`: a checkpoint as a Hugging Face model directory.

Reads the checkpoint ``latest`` names (or --iteration N) on the CPU, merges its TP/PP shards and
writes config.json + model.safetensors that ``transformers`` loads with ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint.metadata import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="entrypoint convert",
        description="Convert an mds checkpoint. GPT-2 style models (learned positions, LayerNorm, GeLU) become "
                    "GPT2LMHeadModel, LLaMA style (rope, RMSNorm, SwiGLU) LlamaForCausalLM. TP and PP shards are "
                    "merged and the vocabulary padding is trimmed. Runs on the CPU, no process group needed.")
    p.add_argument("--to", required=True, choices=["hf"], help="target format (hf: Hugging Face transformers)")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory (the one given to --save)")
    p.add_argument("--output", required=True, metavar="OUT", help="directory to write config.json and "
                   "model.safetensors to")
    p.add_argument("--iteration", type=int, help="convert iter_N instead of the checkpoint `latest` names")
    p.add_argument("--vocab-size", type=int, help="unpadded vocabulary size (default: from the tokenizer the "
                   "checkpoint was trained with)")
    return p


def checkpoint_directory(load: str, iteration: int | None) -> str:
    if iteration is not None:
        directory = os.path.join(load, paths.tag_for(iteration))
        if not os.path.isdir(directory):
            raise CheckpointError(f"--iteration {iteration}: {directory} does not exist")
        return directory
    tag = paths.read_latest(load)
    if tag is None:
        what = "does not exist" if not os.path.isdir(load) else "has no 'latest' checkpoint"
        raise CheckpointError(f"--load {load} {what}")
    directory = os.path.join(load, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"--load {load}: 'latest' names {tag!r} but {directory} does not exist")
    return directory


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ds.checkpoint import hf
    from megatron_ds.checkpoint.shards import merged_state_dict

    try:
        directory = checkpoint_directory(os.path.abspath(args.load), args.iteration)
        metadata = meta.read(directory)
        meta.check_complete(directory, metadata)
        print(f"convert: reading {directory} (iteration {metadata['iteration']}, TP {metadata['layout']['tp']}, "
              f"PP {metadata['layout']['pp']})", flush=True)
        state_dict = merged_state_dict(directory, metadata)
        config = hf.export(state_dict, metadata["args"], args.output, vocab_size=args.vocab_size)
    except CheckpointError as exc:
        print(f"entrypoint convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"convert: wrote {config['architectures'][0]} ({config['vocab_size']} tokens) to "
          f"{os.path.abspath(args.output)}", flush=True)
    return 0
