"""Process groups for tensor (TP), data (DP), pipeline (PP) and DeepSpeed-Ulysses sequence (SP) parallelism.

Rank order is Megatron's and DeepSpeed's: TP fastest, then DP, then PP, i.e.
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``. TP peers are neighbours, so on a node
they share NVLink; DeepSpeed's pipeline topology ("pipe", "data", "model") lays ranks out the same
way, which lets its engine and our layers agree on who is whom.

Ulysses (``sp`` > 1, --ds-sequence-parallel-size) is carved out of data parallelism as in
Megatron-DeepSpeed: SP peers are neighbours (``rank = dp_rank * sp + sp_rank`` with TP = PP = 1, the only
layout Megatron-DeepSpeed allows), DP strides over them, and ZeRO partitions and reduces gradients over
the "sequence data parallel" group (all DP x SP ranks of a TP/PP coordinate).

``ParallelDims`` is pure arithmetic and validates before any process group exists;
``init_parallel`` then creates the groups and ``get_state`` hands them out by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A tp x pp x dp layout that cannot fit the world (or the model); the message names every factor.

    `flag` is the command-line flag to change (None for the world size, which the launcher sets).
    """

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class ParallelDims:
    """world = tp * pp * dp * sp, checked before any group exists (sp: Ulysses, 1 = off)."""

    world: int
    tp: int
    pp: int
    sp: int = 1

    def __post_init__(self) -> None:
        for name, flag, value in (("world size", None, self.world),
                                  ("--tensor-model-parallel-size", "--tensor-model-parallel-size", self.tp),
                                  ("--pipeline-model-parallel-size", "--pipeline-model-parallel-size", self.pp),
                                  ("--ds-sequence-parallel-size", "--ds-sequence-parallel-size", self.sp)):
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}", flag)
        if self.sp > 1:
            # Megatron-DeepSpeed's initialize_model_parallel asserts the same: Ulysses splits the sequence and
            # all heads over SP, and neither its grid nor its engine compose that with TP or PP.
            for flag, value in (("--tensor-model-parallel-size", self.tp),
                                ("--pipeline-model-parallel-size", self.pp)):
                if value > 1:
                    raise ParallelConfigError(
                        f"--ds-sequence-parallel-size {self.sp} cannot be combined with {flag} {value} "
                        "(DeepSpeed-Ulysses runs with TP = PP = 1, as in Megatron-DeepSpeed)",
                        "--ds-sequence-parallel-size")
            if self.world % self.sp:
                raise ParallelConfigError(
                    f"world size {self.world} is not divisible by --ds-sequence-parallel-size {self.sp}",
                    "--ds-sequence-parallel-size")
        if self.world % (self.tp * self.pp):
            raise ParallelConfigError(
                f"world size {self.world} is not divisible by --tensor-model-parallel-size {self.tp} x "
                f"--pipeline-model-parallel-size {self.pp} = {self.tp * self.pp}; "
                f"data-parallel size would be {self.world / (self.tp * self.pp):g}", "--tensor-model-parallel-size")

    @property
    def dp(self) -> int:
        """Pure data parallelism: replicas that see different samples (SP ranks share theirs)."""
        return self.world // (self.tp * self.pp * self.sp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.sp * self.tp), (rank // (self.sp * self.tp)) % self.dp, rank % self.tp

    def sp_rank(self, rank: int) -> int:
        """A global rank's position in its Ulysses group (its slice of the sequence)."""
        return (rank // self.tp) % self.sp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, sp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.sp + sp_rank) * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t, q) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for q in range(self.sp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t, q) for d in range(self.dp)]
                for p in range(self.pp) for q in range(self.sp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t, q) for p in range(self.pp)]
                for d in range(self.dp) for q in range(self.sp) for t in range(self.tp)]

    def sp_groups(self) -> list[list[int]]:
        """Ulysses groups: the ranks that hold the slices of the same sequences."""
        return [[self.rank_of(p, d, t, q) for q in range(self.sp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def sp_dp_groups(self) -> list[list[int]]:
        """DP x SP ("sequence data parallel"): where ZeRO partitions and gradients are reduced."""
        return [[self.rank_of(p, d, t, q) for d in range(self.dp) for q in range(self.sp)]
                for p in range(self.pp) for t in range(self.tp)]


@dataclass
class ParallelState:
    """This rank's coordinates and groups (a group is None when torch.distributed is not initialised)."""

    dims: ParallelDims
    rank: int
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    sp_group: object = None  # Ulysses; None when sp == 1
    sp_dp_group: object = None  # DP x SP; the DP group when sp == 1

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def sp_size(self) -> int:
        return self.dims.sp

    @property
    def sp_rank(self) -> int:
        return self.dims.sp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, first stage first."""
        return [self.dims.rank_of(p, self.dp_rank, self.tp_rank, self.sp_rank) for p in range(self.pp_size)]

    def mpu(self) -> "DeepSpeedMPU":
        return DeepSpeedMPU(self)


_STATE: ParallelState | None = None


def local_device_index() -> int:
    """This rank's GPU: its local rank among the GPUs it sees. Every rank normally sees all GPUs of the node
    (DESIGN.md); modulo keeps a site that hands each task only its own GPU (`--gpus-per-task`) working."""
    import torch

    return int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())


def init_parallel(tp: int = 1, pp: int = 1, backend: str | None = None,
                  timeout_minutes: float | None = None, sp: int = 1) -> ParallelState:
    """Init torch.distributed from env:// if needed, then build the TP/DP/PP (and, sp > 1, SP) groups.

    Every rank must call this (``new_group`` is collective), with the same tp, pp and sp.
    ``timeout_minutes`` (--distributed-timeout-minutes) bounds each collective of these groups
    (None: torch's default).
    """
    # torch 2.1 refuses timeout=None: pass it only when given
    timeout = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    global _STATE
    if not dist.is_initialized():
        if backend is None:
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
        if missing:
            raise RuntimeError(f"init_parallel: torch.distributed is not initialised and {', '.join(missing)} "
                               "unset; launch through `entrypoint` (or torchrun) so env:// can rendezvous")
        if backend == "nccl":
            import torch

            torch.cuda.set_device(local_device_index())  # NCCL binds its communicator to it
        dist.init_process_group(backend=backend, init_method="env://", **timeout)
    dims = ParallelDims(dist.get_world_size(), tp, pp, sp)
    rank = dist.get_rank()
    state = ParallelState(dims, rank)
    layout = [("tp_group", dims.tp_groups()), ("dp_group", dims.dp_groups()), ("pp_group", dims.pp_groups())]
    if sp > 1:
        layout += [("sp_group", dims.sp_groups()), ("sp_dp_group", dims.sp_dp_groups())]
    for attr, groups in layout:
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, **timeout)
            if rank in ranks:
                setattr(state, attr, group)
    if sp == 1:
        state.sp_dp_group = state.dp_group
    _STATE = state
    return state


def get_state() -> ParallelState:
    """The state from init_parallel, or a single-process TP=PP=DP=1 state when none was built."""
    if _STATE is None:
        return ParallelState(ParallelDims(1, 1, 1), 0)
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def destroy() -> None:
    """Forget the groups and tear down torch.distributed (if we or anyone initialised it)."""
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed expects (Megatron's method names).

    "Model parallel" means tensor parallel here, as in DeepSpeed's own pipeline grid: DeepSpeed
    reduces gradient norms over this group and counts replicated parameters on its rank 0 only.
    """

    def __init__(self, state: ParallelState):
        self.state = state

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_model_parallel_group(self):
        return self.state.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.state.rank - self.state.tp_rank

    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group(self):
        return self.state.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        s = self.state
        return [s.dims.rank_of(s.pp_rank, d, s.tp_rank, s.sp_rank) for d in range(s.dp_size)]

    # Ulysses. DeepSpeed reads these (utils/groups.py): it reduces gradients and partitions ZeRO over the
    # sequence data parallel group, then divides by its size / SP size, i.e. it averages over DP and SUMS over
    # SP (each SP rank's loss must therefore be its share of the full-sequence loss, see model/gpt.py).
    # No `initialize_sequence_parallel` here: that name switches DeepSpeed to its own SP groups.
    def get_sequence_parallel_group(self):
        return self.state.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.state.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.state.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.state.sp_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.state.dp_size * self.state.sp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.state.dp_rank * self.state.sp_size + self.state.sp_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.state.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.state.pp_size

    def get_pipe_parallel_group(self):
        return self.state.pp_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group


def mpu() -> DeepSpeedMPU:
    """DeepSpeed's ``mpu`` for the current state (``deepspeed.initialize(..., mpu=mpu())``)."""
    return get_state().mpu()
