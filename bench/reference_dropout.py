"""Steering's plain-PyTorch reference GPT with Megatron's dropout, for a like-for-like yardstick of the default flags.

The reference (../shared/bench/reference_gpt.py, carried in .whl/) computes no dropout, while `entrypoint train`'s
defaults drop 0.1 of the attention probabilities and of each residual branch. This runs the reference unchanged
except for its block's forward, which applies those two dropouts where Megatron does, so that "our default flags
against the reference" can be read with the same math on both sides. Arguments after the path go to the reference:

    python bench/reference_dropout.py .whl/reference_gpt.py --which compile --mbs 16 --steps 10 --warmup 3
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch.nn.functional as F

DROPOUT = float(os.environ.get("REFERENCE_DROPOUT", "0.1"))


def forward_with_dropout(block, x):
    """Megatron's placement: attention dropout on the softmax probabilities (inside SDPA), hidden dropout on the
    attention and MLP outputs before each residual add."""
    batch, seq, hidden = x.shape
    heads = block.nh
    qkv = block.qkv(block.ln1(x)).view(batch, seq, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
    p = DROPOUT if block.training else 0.0
    context = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True, dropout_p=p)
    x = x + F.dropout(block.proj(context.transpose(1, 2).reshape(batch, seq, hidden)), p, block.training)
    mlp = block.out(F.gelu(block.fc(block.ln2(x)), approximate="tanh"))
    return x + F.dropout(mlp, p, block.training)


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        raise SystemExit("usage: reference_dropout.py PATH/reference_gpt.py [reference arguments]")
    spec = importlib.util.spec_from_file_location("reference_gpt", sys.argv[1])
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    reference.Block.forward = forward_with_dropout
    print(f"reference with dropout {DROPOUT} (attention probabilities and both residual branches)", flush=True)
    sys.argv = sys.argv[1:]  # the reference parses its own arguments
    reference.main()


if __name__ == "__main__":
    main()
