"""mds: Megatron-DeepSpeed-style GPT pretraining, packaged to run the same everywhere.

One concern per subpackage, in layers; each imports only from the layers below it (tests/test_import_layers.py
holds the order and checks every import, lazy ones included):

    demo                      make demo
    convert                   entrypoint convert: checkpoints in and out of mds, and across layouts
    training                  flags and their rules, building a run (build.py), the loop
    precision | checkpoint    bf16/fp16/FP8 around the model's GEMMs | checkpoint files
    model                     the GPT, plain torch over our parallel layers (no DeepSpeed)
    parallel                  process groups, tensor/sequence-parallel building blocks
    runtime | data            ranks, sites, launching (no models) | indexed datasets, tokenizers
    torch_support             what the installed torch can do
    env_settings | compile_costs   every MDS_* variable, read here only | what compiling cost at start-up
    image_flavours            the image flavours, one table (image_flavours.json)
"""

__version__ = "0.1.0"
