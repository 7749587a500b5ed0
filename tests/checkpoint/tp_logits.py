"""Ground-truth logits of a checkpoint, computed the way training runs the model: TP-sharded.

Each rank builds GPTModel with the checkpoint's own flags at the checkpoint's TP size, loads ITS
OWN shard file (mp_rank_XX_model_states.pt, no merging), and the vocab-parallel logits are
gathered. The export is then checked against these, so a mistake in the shard merge cannot hide.
Usage (one process per rank): tp_logits.py CHECKPOINT_DIR TOKENS.pt OUT.pt
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main(directory: str, tokens_path: str, out_path: str) -> int:
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.arguments.settings import model_config
    from megatron_ds.model.gpt import GPTModel
    from megatron_ds.parallel.state import destroy, init_parallel
    from megatron_ds.precision import precision_from

    metadata = json.load(open(os.path.join(directory, "mds_checkpoint.json")))
    settings = settings_from_stored(metadata["args"])
    state = init_parallel(metadata["layout"]["tp"], 1, backend="gloo")
    module = torch.load(os.path.join(directory, f"mp_rank_{state.tp_rank:02d}_model_states.pt"),
                        map_location="cpu", weights_only=False)["module"]
    padded_vocab = module["embedding.word_embeddings.weight"].shape[0] * state.tp_size
    precision = precision_from(settings.precision, settings.model.transformer_impl)
    config = model_config(settings, padded_vocab, precision.params_dtype)
    config.attention_backend = "reference"
    model = GPTModel(config, tp_group=state.tp_group)
    model.load_state_dict(module, strict=True)
    model.eval()
    with torch.no_grad():
        local = model(torch.load(tokens_path))  # [b, s, V/tp]
    gathered = [torch.empty_like(local) for _ in range(state.tp_size)]
    dist.all_gather(gathered, local.contiguous(), group=state.tp_group)
    if state.rank == 0:
        torch.save(torch.cat(gathered, dim=-1), out_path)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
