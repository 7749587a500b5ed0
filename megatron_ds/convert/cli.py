"""`entrypoint convert`: checkpoints in and out of mds, on the CPU, no process group.

- ``--to hf --load DIR --output OUT``: the checkpoint ``latest`` names (or --iteration N), TP/PP shards
  merged, as config.json + model.safetensors that ``transformers`` loads with ``from_pretrained``.
- ``--from hf HF_DIR --to DIR [--tensor-model-parallel-size N --pipeline-model-parallel-size M]``: a
  GPT-2 or LLaMA HF model directory as an mds checkpoint (weights only) that
  ``entrypoint train --load DIR --finetune`` continues with the model flags printed.
- ``--reshard --load DIR --to NEW --tensor-model-parallel-size N --pipeline-model-parallel-size M
  --data-parallel-size D [--zero-stage Z]``: the checkpoint (weights, Adam moments, fp32 master weights,
  step, LR schedule, consumed samples) rewritten at another layout (reshard.py); ``entrypoint train
  --load NEW`` at that layout resumes it. This one starts rank processes (gloo, CPU) at both layouts.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint.metadata import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="entrypoint convert",
        description="Convert an mds checkpoint. GPT-2 style models (learned positions, LayerNorm, GeLU) become "
                    "GPT2LMHeadModel, LLaMA style (rope, RMSNorm, SwiGLU) LlamaForCausalLM. TP and PP shards are "
                    "merged and the vocabulary padding is trimmed. Runs on the CPU, no process group needed.")
    p.add_argument("--to", required=True, metavar="hf|DIR", help="export: the target format (hf: Hugging Face "
                   "transformers); import (with --from): the new mds checkpoint directory")
    p.add_argument("--from", dest="source", nargs=2, metavar=("FORMAT", "SRC"),
                   help="import: FORMAT hf (a GPT2LMHeadModel or LlamaForCausalLM directory with config.json "
                        "and safetensors), or megatron-deepspeed (a GPT checkpoint in Megatron's "
                        "mp_rank_XX[_YYY]/model_optim_rng.pt or DeepSpeed's layer_XX-model_YY files) from SRC")
    p.add_argument("--qkv-order", choices=("auto", "grouped", "thirds"), default="auto",
                   help="import megatron-deepspeed: the row order of query_key_value; grouped: per KV group its "
                        "query heads, k, v (Megatron-DeepSpeed up to Dec 2024, Megatron's checkpoint_version 2.0/3.0); "
                        "thirds: [q; k; v] per TP rank (Megatron-DeepSpeed since its FPDT commit, Dec 2024); auto "
                        "(default): thirds when the saved args know --ds-sequence-parallel-fpdt and the model is MHA")
    p.add_argument("--reshard", action="store_true", help="rewrite the checkpoint in --load at another TP x PP x "
                   "DP layout and ZeRO stage into the empty directory --to, optimizer state included")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="import, reshard: TP size to write (default 1)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="import, reshard: PP size to write (default 1)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="reshard: DP size to write (default 1)")
    p.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="reshard: DeepSpeed-Ulysses size to write (default 1; the source's is read from it)")
    p.add_argument("--zero-stage", type=int, help="reshard: ZeRO stage to write (default: the checkpoint's)")
    p.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="import: pad the vocabulary to a multiple of this x TP, as training does (default 128); "
                        "reshard: default the checkpoint's value")
    p.add_argument("--load", metavar="DIR", help="export: checkpoint directory (the one given to --save)")
    p.add_argument("--output", metavar="OUT", help="export: directory to write config.json and "
                   "model.safetensors to")
    p.add_argument("--iteration", type=int, help="convert iter_N instead of the checkpoint `latest` names")
    p.add_argument("--vocab-size", type=int, help="unpadded vocabulary size (default: from the tokenizer the "
                   "checkpoint was trained with)")
    return p


def import_main(args, parser) -> int:
    from megatron_ds.convert import hf_import, megatron_deepspeed

    fmt, source = args.source
    if fmt not in IMPORT_FORMATS:
        parser.error(f"--from: format {fmt!r} is not one of {', '.join(IMPORT_FORMATS)}")
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    try:
        if fmt == "hf":
            if args.qkv_order != "auto":
                parser.error("--qkv-order is for --from megatron-deepspeed")
            importer = hf_import.import_hf
        else:
            importer = functools.partial(megatron_deepspeed.import_megatron_deepspeed, qkv_order=args.qkv_order)
        result = importer(source, os.path.abspath(args.to), tp=args.tensor_model_parallel_size,
                          pp=args.pipeline_model_parallel_size,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by or 128)
    except CheckpointError as exc:
        print(f"entrypoint convert: error: {exc}", file=sys.stderr)
        return 2
    print(hf_import.describe(result), flush=True)
    return 0


IMPORT_FORMATS = ("hf", "megatron-deepspeed")


def refuse_experts(directory: str, metadata: dict, action: str) -> None:
    """CheckpointError for a Mixture-of-Experts checkpoint: DeepSpeed keeps its experts in files of their own
    (layer_L_expert_E_*), which neither the HF export nor the resharding reads yet."""
    saved = metadata["args"]
    experts = saved.get("num_experts") or [1]
    if max(experts) > 1:
        why = ("Hugging Face's GPT-2 and LLaMA classes have no experts (an MoE model has no HF counterpart here)"
               if action == "--to hf" else "resharding does not move DeepSpeed's expert files (layer_*_expert_*) "
               "between expert-parallel sizes yet; resume at the checkpoint's layout (--moe-expert-parallel-size "
               f"{saved.get('moe_expert_parallel_size', 1)})")
        raise CheckpointError(f"{action}: {directory} is a Mixture-of-Experts checkpoint (--num-experts "
                              f"{' '.join(map(str, experts))}): not supported: {why}")


def reshard_main(args, parser) -> int:
    from megatron_ds.checkpoint.checkpointing import checkpoint_directory
    from megatron_ds.convert import reshard

    if not args.load or args.to in (None, "hf"):
        parser.error("--reshard needs --load DIR (the checkpoint) and --to NEW (an empty directory)")
    try:
        zero_stage = args.zero_stage
        directory = checkpoint_directory(os.path.abspath(args.load), args.iteration)
        source = meta.read(directory)
        refuse_experts(directory, source, "--reshard")
        if zero_stage is None:
            zero_stage = int(source["layout"]["zero_stage"])
        reshard.reshard(args.load, args.to, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                        dp=args.data_parallel_size, zero_stage=zero_stage, sp=args.ds_sequence_parallel_size,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, iteration=args.iteration)
    except CheckpointError as exc:
        print(f"entrypoint convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.source is not None:
        return import_main(args, parser)
    if args.reshard:
        return reshard_main(args, parser)
    if args.to != "hf":
        parser.error(f"--to {args.to}: exporting writes 'hf'; to import, name the source with --from FORMAT SRC")
    if not args.load or not args.output:
        parser.error("--to hf needs --load DIR and --output OUT")
    from megatron_ds.checkpoint.checkpointing import checkpoint_directory
    from megatron_ds.checkpoint.shards import merged_state_dict
    from megatron_ds.convert import hf_export

    try:
        directory = checkpoint_directory(os.path.abspath(args.load), args.iteration)
        metadata = meta.read(directory)
        meta.check_complete(directory, metadata)
        refuse_experts(directory, metadata, "--to hf")
        print(f"convert: reading {directory} (iteration {metadata['iteration']}, TP {metadata['layout']['tp']}, "
              f"PP {metadata['layout']['pp']})", flush=True)
        state_dict = merged_state_dict(directory, metadata)
        config = hf_export.export(state_dict, metadata["args"], args.output, vocab_size=args.vocab_size)
    except CheckpointError as exc:
        print(f"entrypoint convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"convert: wrote {config['architectures'][0]} ({config['vocab_size']} tokens) to "
          f"{os.path.abspath(args.output)}", flush=True)
    return 0
