"""A Megatron-DeepSpeed GPT forward written from upstream's semantics, for checking our importer.

It never touches mds's model: random per-TP-rank weights in upstream's names and shapes, and a forward
that reads them the way upstream's ranks do (megatron/model/transformer.py: ``ParallelAttention.forward``
splits each rank's fused ``query_key_value`` output in the order given below, ``repeat_kv`` shares a KV head
with the query heads of its group, ``ParallelMLP``'s SwiGLU is ``torch.chunk(x, 2, dim=-1)`` of the
rank's ``dense_h_to_4h`` output, row-parallel partial sums are added over ranks;
rotary_pos_embedding.py: rotate-half rope). Orders of the query_key_value rows per rank:
``grouped`` [nkv, nq/nkv + 2, hn] (up to Dec 2024, checkpoint_version 2.0/3.0), ``thirds`` [q; k; v]
(since Dec 2024; checkpoint_version 0 too), ``v1`` [np, hn, 3] (checkpoint_version 1.0), and ``split``:
separate ``query`` and ``key_value`` ([nkv, 2 * hn]) linears (GQA before Nov 2023).
"""

from __future__ import annotations

import math
from argparse import Namespace

import torch
import torch.nn.functional as F


def _randn(generator: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


def random_pieces(args: Namespace, tp: int, order: str, seed: int = 0) -> list[dict]:
    """Per TP rank: {"embedding": {...}, "layers": [{Megatron name: tensor}], "final": {...}, "head": tensor|None}.

    Replicated tensors (norms, position embeddings, row-parallel biases) are equal on every rank."""
    h, heads, kv = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    hn, ffn, vocab = h // heads, args.ffn_hidden_size, args.padded_vocab_size
    shared = torch.Generator().manual_seed(seed)
    ranked = [torch.Generator().manual_seed(seed + 1 + r) for r in range(tp)]

    def norm():
        weight = 1 + _randn(shared, h, scale=0.1)
        return {"weight": weight} if args.normalization == "rmsnorm" else {"weight": weight,
                                                                           "bias": _randn(shared, h, scale=0.1)}

    def linear(name, rows, cols, bias_shared):
        out = [{f"{name}.weight": _randn(g, rows, cols, scale=cols ** -0.5)} for g in ranked]
        if args.add_bias_linear:
            bias = _randn(shared, rows, scale=0.1)
            for g, piece in zip(ranked, out):
                piece[f"{name}.bias"] = bias if bias_shared else _randn(g, rows, scale=0.1)
        return out

    pieces = [{"embedding": {}, "layers": [], "final": {}, "head": None} for _ in range(tp)]
    for g, piece in zip(ranked, pieces):
        piece["embedding"]["word_embeddings.weight"] = _randn(g, vocab // tp, h, scale=1.0)
    if not args.use_rotary_position_embeddings:
        position = _randn(shared, args.max_position_embeddings, h, scale=0.3)
        for piece in pieces:
            piece["embedding"]["position_embeddings.weight"] = position
    for _ in range(args.num_layers):
        layer = [{} for _ in range(tp)]
        ln1, ln2 = norm(), norm()
        if order == "split":
            attention = [dict(a, **b) for a, b in zip(linear("self_attention.query", heads * hn // tp, h, False),
                                                       linear("self_attention.key_value", 2 * kv * hn // tp, h, False))]
        else:
            attention = linear("self_attention.query_key_value", (heads + 2 * kv) * hn // tp, h, False)
        dense = linear("self_attention.dense", h, heads * hn // tp, True)
        fc1 = linear("mlp.dense_h_to_4h", (2 if args.swiglu else 1) * ffn // tp, h, False)
        fc2 = linear("mlp.dense_4h_to_h", h, ffn // tp, True)
        for r in range(tp):
            for part in (attention, dense, fc1, fc2):
                layer[r].update(part[r])
            layer[r].update({f"input_layernorm.{k}": v for k, v in ln1.items()})
            layer[r].update({f"post_attention_layernorm.{k}": v for k, v in ln2.items()})
            pieces[r]["layers"].append(layer[r])
    final = norm()
    for g, piece in zip(ranked, pieces):
        piece["final"] = dict(final)
        if args.untie_embeddings_and_output_weights:
            piece["head"] = _randn(g, vocab // tp, h, scale=h ** -0.5)
    return pieces


def _norm(x, weights: dict, args: Namespace, prefix: str = "") -> torch.Tensor:
    weight = weights[f"{prefix}weight"]
    if args.normalization == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.layernorm_epsilon) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, weights[f"{prefix}bias"], args.layernorm_epsilon)


def _linear(x, piece: dict, name: str) -> torch.Tensor:
    return F.linear(x, piece[f"{name}.weight"], piece.get(f"{name}.bias"))


def _rope(t: torch.Tensor, theta: float) -> torch.Tensor:
    """t [s, b, n, hn], rotate-half (upstream's apply_rotary_pos_emb with cat(freqs, freqs))."""
    s, hn = t.shape[0], t.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hn, 2).float() / hn))
    freqs = torch.outer(torch.arange(s).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    x1, x2 = t[..., : hn // 2], t[..., hn // 2:]
    return t * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


def _split_qkv(piece: dict, y: torch.Tensor, order: str, heads: int, kv: int, hn: int):
    """This rank's q [s, b, heads, hn], k and v [s, b, kv, hn], read as upstream's forward of that era does."""
    s, b = y.shape[:2]
    if order == "split":
        q = _linear(y, piece, "self_attention.query").view(s, b, heads, hn)
        k, v = _linear(y, piece, "self_attention.key_value").view(s, b, kv, 2 * hn).split(hn, dim=-1)
        return q, k, v
    mixed = _linear(y, piece, "self_attention.query_key_value")
    if order == "grouped":  # [s, b, nkv, nq/nkv + 2, hn] split into [group, 1, 1]
        mixed = mixed.view(s, b, kv, heads // kv + 2, hn)
        q, k, v = mixed.split([heads // kv, 1, 1], dim=-2)
        return q.reshape(s, b, heads, hn), k.squeeze(-2), v.squeeze(-2)
    if order == "v1":  # [s, b, np, hn, 3]
        mixed = mixed.view(s, b, heads, hn, 3)
        return mixed[..., 0], mixed[..., 1], mixed[..., 2]
    assert order == "thirds"
    each = mixed.shape[-1] // 3
    return tuple(mixed[..., i * each:(i + 1) * each].reshape(s, b, -1, hn) for i in range(3))


def _attention(piece: dict, y, args: Namespace, order: str, tp: int) -> torch.Tensor:
    heads, kv = args.num_attention_heads // tp, args.num_key_value_heads // tp
    hn = args.hidden_size // args.num_attention_heads
    q, k, v = _split_qkv(piece, y, order, heads, kv, hn)
    if args.use_rotary_position_embeddings:
        q, k = _rope(q, args.rope_theta), _rope(k, args.rope_theta)
    k, v = (t.repeat_interleave(heads // kv, dim=2) for t in (k, v))  # repeat_kv: kv head j serves q heads j*g..
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hn)
    s = y.shape[0]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, y.shape[1], heads * hn)
    return F.linear(context, piece["self_attention.dense.weight"])  # the partial sum of the row-parallel GEMM


def _mlp(piece: dict, y, args: Namespace) -> torch.Tensor:
    hidden = _linear(y, piece, "mlp.dense_h_to_4h")
    if args.swiglu:
        gate, up = torch.chunk(hidden, 2, dim=-1)
        hidden = F.silu(gate) * up
    else:  # Megatron: its fused bias-GeLU (the default) and --openai-gelu are the tanh approximation
        tanh = getattr(args, "openai_gelu", False) or (args.bias_gelu_fusion and args.add_bias_linear)
        hidden = F.gelu(hidden, approximate="tanh" if tanh else "none")
    return F.linear(hidden, piece["mlp.dense_4h_to_h.weight"])


def logits(pieces: list[dict], args: Namespace, order: str, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, padded vocab] for tokens [b, s], each rank's share computed from its own weights only."""
    tp = len(pieces)
    words = torch.cat([p["embedding"]["word_embeddings.weight"] for p in pieces])
    x = words[tokens.t()]  # [s, b, h]
    if "position_embeddings.weight" in pieces[0]["embedding"]:
        x = x + pieces[0]["embedding"]["position_embeddings.weight"][: tokens.shape[1], None, :]
    for i in range(args.num_layers):
        layers = [p["layers"][i] for p in pieces]
        y = _norm(x, layers[0], args, "input_layernorm.")
        x = x + sum(_attention(layer, y, args, order, tp) for layer in layers) + layers[0].get(
            "self_attention.dense.bias", 0)
        y = _norm(x, layers[0], args, "post_attention_layernorm.")
        x = x + sum(_mlp(layer, y, args) for layer in layers) + layers[0].get("mlp.dense_4h_to_h.bias", 0)
    x = _norm(x, pieces[0]["final"], args)
    head = words if pieces[0]["head"] is None else torch.cat([p["head"] for p in pieces])
    return (x @ head.t()).transpose(0, 1)
