"""The weight names the checkpoint reader and the HF export use, for checkpoints from before and after the
parallel linears held their GEMM as a ``local`` child."""

import torch

from megatron_ds.checkpoint.shards import current_name, merged_state_dict
from megatron_ds.convert import hf_export as hf
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel

ARGS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, swiglu=False,
            position_embedding_type="learned_absolute", normalization="LayerNorm",
            untie_embeddings_and_output_weights=True, disable_bias_linear=False)


def test_current_name_maps_only_the_gemm_parameters():
    assert current_name("layers.3.attention.qkv.weight") == "layers.3.attention.qkv.local.weight"
    assert current_name("layers.3.attention.qkv.bias") == "layers.3.attention.qkv.local.bias"
    assert current_name("layers.0.mlp.fc1.bias") == "layers.0.mlp.fc1.local.bias"
    assert current_name("layers.0.mlp.fc2.weight") == "layers.0.mlp.fc2.local.weight"
    assert current_name("layers.0.attention.proj.weight") == "layers.0.attention.proj.local.weight"
    assert current_name("output_head.linear.weight") == "output_head.linear.local.weight"
    for unchanged in ("layers.0.attention.proj.bias", "layers.0.mlp.fc2.bias", "layers.0.input_norm.weight",
                      "embedding.word_embeddings.weight", "layers.0.attention.qkv.local.weight",
                      "final_norm.norm.weight"):
        assert current_name(unchanged) == unchanged


def test_older_checkpoint_files_read_and_export_as_current_ones(tmp_path):
    model = GPTModel(GPTConfig(**{k: v for k, v in ARGS.items() if k not in ("disable_bias_linear",)},
                               vocab_size=128, add_bias_linear=True))
    current = model.state_dict()
    metadata = {"layout": {"tp": 1, "pp": 1}, "args": ARGS}
    exported = {}
    for name, state in (("current", current), ("legacy", {k.replace(".local.", "."): v for k, v in current.items()})):
        directory = tmp_path / name
        directory.mkdir()
        torch.save({"module": state}, directory / "mp_rank_00_model_states.pt")
        merged = merged_state_dict(str(directory), metadata)
        assert merged.keys() == current.keys()
        assert all(torch.equal(merged[k], current[k]) for k in current)
        hf.export(merged, ARGS, str(tmp_path / f"hf-{name}"), vocab_size=100)
        from safetensors.torch import load_file
        exported[name] = load_file(str(tmp_path / f"hf-{name}" / "model.safetensors"))
    assert exported["current"].keys() == exported["legacy"].keys()
    assert all(torch.equal(exported["current"][k], exported["legacy"][k]) for k in exported["current"])
    assert torch.equal(exported["current"]["transformer.h.0.attn.c_attn.weight"],
                       current["layers.0.attention.qkv.local.weight"].t())
