"""`entrypoint convert` (cli.py): checkpoints in and out of mds, and from one layout to another.

- hf_export.py: an mds checkpoint as a Hugging Face model (TP/PP shards merged);
- hf_import.py, megatron_deepspeed.py (with megatron_qkv.py): HF and Megatron-DeepSpeed checkpoints as mds
  checkpoints at a chosen TP x PP;
- reshard.py, reshard_rank.py: an mds checkpoint, optimizer state included, rewritten at another TP x PP x DP
  layout and ZeRO stage through a real training engine at each end (training/build.py builds it).

It sits above both checkpoint/ (the files) and training/ (flags, rules, the engine), and nothing imports it
but entrypoint.
"""
