"""mds: Megatron-DeepSpeed-style GPT pretraining, packaged to run the same everywhere."""

__version__ = "0.1.0"
