"""Tensor-parallel communication overlapped with compute by the compiler (``--tp-comm-overlap``).

Eager layers issue each TP collective where the math needs it and wait for it at once. In a compiled layer the
collectives are graph nodes (torch's functional ones, see mappings.py), so inductor may move them; the modes:

- ``reorder``: inductor's compute/communication reordering issues each collective as early as its input allows
  and waits as late as its first consumer allows (within the peak memory of the plain schedule). It moves
  collectives and waits, not compute, so it hides only what the schedule already puts between them: in our
  layers' backward the norms' small all-reduces, since inductor's peak-memory pass puts the weight-gradient
  GEMMs at the end of the graph (as inductor's generated code shows).
- ``pipeline`` (with ``--sequence-parallel``, on CUDA): torch's asynchronous TP as well. Each all-gather ->
  GEMM and GEMM -> reduce-scatter pair becomes one fused op that works through the ranks' chunks over symmetric
  memory, so the forward's sequence gathers overlap their own GEMM (nothing else in the forward is independent
  of them). Inductor keeps the plain overlap where ``reorder`` already hides a collective. Measured slower than
  ``reorder`` on 2 x H100 (bench/RESULTS.md), so it runs only when asked for by name.

- ``chunked`` (with ``--sequence-parallel``): ``reorder``'s passes, and each sequence-parallel GEMM split by
  the ranks' sequence chunks (parallel/chunked.py), so the forward's gathers and scatters, too, have a GEMM to
  run beside, without symmetric memory. It does hide NCCL, but the half-height GEMMs, the partial sums' adds and
  the backward's extra exchanges cost more: 0.965x ``reorder`` on 2 x H100, so opt-in.

- ``wgrad``: ``reorder``'s passes, then ours (parallel/collective_windows.py), which moves an independent GEMM
  (in backward, a weight gradient) between each collective's issue and its wait, as Megatron's asynchronous TP
  all-reduce does by hand: three of the four backward collectives of a sequence-parallel layer get one. 0.988x
  ``reorder`` on GPT-6.7B TP=2+SP (2 x H200), so opt-in.

- ``halves``: ``reorder``'s passes, and each layer runs its micro batch as two halves in an interleaved order
  (TransformerLayer._halves_forward), as DeepSpeed's Domino does by hand: one half's collectives are independent
  of the other half's GEMMs, so the passes can issue them beside each other in the forward too, with full-height
  GEMMs (chunked's are split) and no symmetric memory. Needs a micro batch of at least 2. Measured 0.85-0.97x
  ``reorder`` on GPT-2.7B TP=2+SP (2 x H100): it doubles the launches, and the host, already near the
  GPU's pace, fell behind (rank 0's GPU idle 263 ms per step against 18). Opt-in.

``halves`` splits the batch, so dropout draws each half's mask on its own: the same distribution, other masks.
The others change the schedule only: the same kernels compute the same sums (tests compare against the eager layer).
``reorder`` is the default wherever it can run (compiled layers, TP > 1): GPT-6.7B TP=2+SP with gradient
accumulation ran 1.03x none in one call, and no layout measured slower.
"""

from __future__ import annotations

MODES = ("reorder", "pipeline", "chunked", "wgrad", "halves")

# Torch's recommended pass list (torch/_inductor/config.py), where this torch has those passes; the older trio
# otherwise. Each pass name is a function in torch._inductor.comms.
_PASSES = (["reorder_communication_preserving_peak_memory", "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory"],
           ["sink_waits", "raise_comms", "reorder_compute_for_overlap"])


def resolve_mode(asked: str | None) -> str | None:
    """The mode that runs for an explicit ``--tp-comm-overlap``: ``auto`` (the bare flag) is ``reorder``, the lever
    that measured fastest (bench/RESULTS.md; ``pipeline`` ran 0.87-0.97x none), ``none`` is off."""
    return {"auto": "reorder", "none": None}.get(asked, asked)


def default_mode(tp: int, compiled: bool) -> str | None:
    """The mode without the flag: ``reorder`` where it can run (TP collectives in compiled layers), else off.

    Every torch that compiles our layers (2.5 and later: torch_support.compile_problem) has at least the older
    trio of passes, so this asks no import of inductor: the launcher, which validates the flags before spawning
    the ranks, spent seconds importing it for nothing (GPT-13B TP=2+SP x PP=2 on 4 x H200: launch and imports
    20 s against 10 s without TP)."""
    return "reorder" if tp > 1 and compiled else None


def _passes() -> list[str] | None:
    """The reordering passes this torch's inductor has (torch._inductor.comms), or None."""
    from torch._inductor import comms

    return next((p for p in _PASSES if all(hasattr(comms, name) for name in p)), None)


def inductor_options(mode: str | None) -> dict | None:
    """torch.compile options for the transformer layers under ``mode`` (None: inductor's defaults; GPTConfig has
    checked the mode)."""
    if mode is None:
        return None
    passes = _passes()
    if passes is None:
        raise RuntimeError("this torch's inductor has none of the compute/communication reordering passes mds uses")
    if mode == "wgrad":
        from megatron_ds.parallel.collective_windows import register

        passes = [*passes, register()]
    options = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": passes}
    if mode == "pipeline":
        options["_micro_pipeline_tp"] = True
    return options


def prepare_group(mode: str | None, group) -> None:
    """Give the TP group symmetric memory, which ``pipeline``'s fused ops exchange their chunks through (newer
    torch calls this unnecessary, yet its asynchronous-TP pass still checks for it)."""
    if mode != "pipeline" or group is None:
        return
    import warnings

    from torch.distributed import _symmetric_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(group.group_name)
