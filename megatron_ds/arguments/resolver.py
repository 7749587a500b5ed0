"""The values validation derives, each computed on first read from the given flags and other derived values.

`Resolver` is what the rules read: a given flag as parsed, a derived value (DERIVED: the value's name -> the
function that computes it) computed once and kept, its refusal kept too. Nothing is written back to the parsed
flags, and since a value is computed when first read, not at a fixed step, the rules may run in any order. A
derived value's notices are kept with it; a rule's with the rule (`notices` is the list of whoever is running).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from megatron_ds.arguments.flags import ConfigError
from megatron_ds.arguments.sources import DS_CONFIG_BATCH, load_ds_config


class Resolver:
    """Read-only: given flags and derived values by name, and `notices`, the list of the rule now running."""

    def __init__(self, given: argparse.Namespace, world_size: int):
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_state", dict(world_size=world_size, values={}, errors={}, notices={},
                                                running=[], busy=set()))

    def given(self, name: str) -> Any:
        return getattr(self._given, name)

    def __getattr__(self, name: str) -> Any:
        if name not in DERIVED:
            return getattr(self._given, name)
        state = self._state
        if name in state["errors"]:
            raise state["errors"][name]
        if name not in state["values"]:
            if name in state["busy"]:
                raise RuntimeError(f"derived values depend on each other in a cycle through {name}")
            state["busy"].add(name)
            try:
                state["values"][name] = self.run(name, lambda: DERIVED[name](self))
            except ConfigError as err:
                state["errors"][name] = err
                raise
            finally:
                state["busy"].discard(name)
        return state["values"][name]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"rules read the flags and do not set them ({name}): derive it in resolver.DERIVED")

    @property
    def world(self) -> int:
        """The number of ranks validation was asked for (the launcher's)."""
        return self._state["world_size"]

    @property
    def notices(self) -> list[str]:
        return self._state["notices"].setdefault(self._state["running"][-1], [])

    def run(self, owner: str, work: Callable[[], Any]) -> Any:
        """`work()`, with the notices it appends kept under `owner` (a rule's or a derived value's name)."""
        self._state["running"].append(owner)
        try:
            return work()
        finally:
            self._state["running"].pop()

    def notices_in(self, owners: list[str]) -> list[str]:
        """The parser's notices, then each owner's in the order given."""
        kept = self._state["notices"]
        return [*self._given.notices, *[line for owner in owners for line in kept.get(owner, [])]]


def positive(flag: str, value: Any, rule: str = "must be positive") -> Any:
    if value is not None and value <= 0:
        raise ConfigError(flag, f"{rule} (got {value})")
    return value


def at_least_zero(flag: str, value: Any) -> Any:
    if value is not None and value < 0:
        raise ConfigError(flag, f"must be >= 0 (got {value})")
    return value


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _required_positive(flag: str) -> Callable[[Resolver], Any]:
    def value(view: Resolver) -> Any:
        if view.given(_dest(flag)) is None:
            raise ConfigError(flag, "is required (give the flag or a --preset that sets it)")
        return positive(flag, view.given(_dest(flag)))
    return value


def _positive(flag: str) -> Callable[[Resolver], Any]:
    return lambda view: positive(flag, view.given(_dest(flag)))


def _file(view: Resolver) -> dict:
    return view.ds_config_file or {}


def _file_batch(view: Resolver, dest: str) -> int | None:
    key = next(key for key, _flag, name in DS_CONFIG_BATCH if name == dest)
    value = _file(view).get(key, "auto")
    return None if value == "auto" else int(value)


def micro_batch_size(view: Resolver) -> int:
    value = view.given("micro_batch_size")
    value = _file_batch(view, "micro_batch_size") if value is None else value
    if value is None:
        raise ConfigError("--micro-batch-size", "is required (flag, MICRO_BATCH, or the DeepSpeed config)")
    return positive("--micro-batch-size", value)


def file_accumulation(view: Resolver) -> int | str | None:
    return _file(view).get("gradient_accumulation_steps")


def global_batch_size(view: Resolver) -> int:
    value = view.given("global_batch_size")
    value = _file_batch(view, "global_batch_size") if value is None else value
    if value is None:
        steps = view.gradient_accumulation_steps_env or file_accumulation(view)
        value = view.micro_batch_size * view.data_parallel_size * int(1 if steps in (None, "auto") else steps)
    return positive("--global-batch-size", value)


def zero_stage(view: Resolver) -> int:
    """--zero-stage, else the file's, else 0; --use-distributed-optimizer shards the optimizer (at least ZeRO-1)."""
    stage = view.given("zero_stage")
    if stage is None:
        stage = int((_file(view).get("zero_optimization") or {}).get("stage", 0))
    if view.use_distributed_optimizer:
        stage = max(stage, 1)
        view.notices.append(f"note: --use-distributed-optimizer: optimizer state is sharded over data-parallel "
                            f"ranks by DeepSpeed ZeRO-{stage}")
    return stage


def lr(view: Resolver) -> float:
    value = view.given("lr")
    params = (_file(view).get("optimizer") or {}).get("params") or {}
    if value is None and "lr" in params:
        value = float(params["lr"])
    if value is None and not view.dry_run:  # a dry run estimates the memory of a layout: no schedule needed
        raise ConfigError("--lr", "is required (or an optimizer section with params.lr in --deepspeed_config)")
    return value


def recompute(view: Resolver) -> tuple[str | None, str | None]:
    """(granularity, method): Megatron's switches in its terms (model.config.recompute_of)."""
    from megatron_ds.model.config import recompute_of

    return recompute_of(view.given("recompute_granularity"), view.given("recompute_method"),
                        view.checkpoint_activations, view.recompute_activations)


def sequence_parallel(view: Resolver) -> bool:
    if view.given("sequence_parallel") and view.tensor_model_parallel_size == 1:  # as Megatron: nothing to split
        view.notices.append("note: --sequence-parallel has no effect with --tensor-model-parallel-size 1; off")
        return False
    return view.given("sequence_parallel")


def dims(view: Resolver):
    """TP x PP x DP x SP = world (ParallelDims' arithmetic; SP is Ulysses, carved out of DP)."""
    from megatron_ds.parallel.state import ParallelConfigError, ParallelDims

    try:
        return ParallelDims(view.world, view.tensor_model_parallel_size, view.pipeline_model_parallel_size,
                            view.ds_sequence_parallel_size)
    except ParallelConfigError as err:
        raise ConfigError(err.flag, without_flag(err.flag, str(err))) from None


def without_flag(flag: str | None, message: str) -> str:
    """A library error's message for ConfigError, which prints `flag: rule` (so the flag is not said twice)."""
    return message[len(flag) + 1:] if flag and message.startswith(flag + " ") else message


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per optimizer step: global = micro x DP x accumulation, which must divide exactly."""
    per_step = micro_batch_size * dp
    if global_batch_size % per_step != 0:
        raise ConfigError("--global-batch-size", f"{global_batch_size} is not divisible by --micro-batch-size "
                          f"{micro_batch_size} x data-parallel size {dp} = {per_step}")
    return global_batch_size // per_step


def train_iters(view: Resolver) -> int:
    """--train-iters, or --train-samples // the global batch; --train-tokens may end the run sooner."""
    samples, iters = view.train_samples, view.given("train_iters")
    if samples is not None:
        if iters is not None:
            raise ConfigError("--train-samples", "give either --train-iters or --train-samples, not both")
        iters = samples // view.global_batch_size
        if iters <= 0:
            raise ConfigError("--train-samples", f"{samples} is less than one global batch "
                              f"({view.global_batch_size})")
    elif iters is None and view.dry_run:  # a dry run estimates the memory of a layout: no length needed
        return None
    elif iters is None:
        raise ConfigError("--train-iters", "is required (or --train-samples; a --preset does not set it)")
    positive("--train-iters", iters)
    tokens = positive("--train-tokens", view.train_tokens)
    if tokens is not None:
        iters = min(iters, -(-tokens // (view.global_batch_size * view.seq_length)))
    return iters


def lr_decay_iters(view: Resolver) -> int | None:
    given = view.given("lr_decay_iters")
    return view.train_iters if given is None and view.train_samples is None else given


def lr_decay_samples(view: Resolver) -> int | None:
    given = view.given("lr_decay_samples")
    return view.train_samples if given is None else given


def torch_compile(view: Resolver) -> bool:
    """--torch-compile given: refused where mds does not compile (capability.compile_off_reason). Not given: on by
    default with a CUDA GPU where mds compiles (measured faster there); eager on CPU, where compiling costs more
    than it saves in small runs and CI."""
    from megatron_ds.arguments import capability

    asked = view.given("torch_compile")
    if asked:
        why = capability.compile_off_reason(view, view.dims)
        if why is not None:
            raise ConfigError("--torch-compile", f"{why}; drop --torch-compile")
        return True
    if asked is not None or not capability.cuda_gpu_visible():
        return False
    if max(view.num_experts or [1]) > 1:
        view.notices.append("note: torch.compile is off by default with MoE: the expert layers compile their "
                            "attention only (DeepSpeed's gate reads the capacity on the host) and that is not yet "
                            "measured against eager on a GPU; --torch-compile turns it on")
        return False
    if capability.fp8_engine(view) == "te":
        view.notices.append("note: torch.compile is off by default with Transformer Engine FP8: its GEMMs break the "
                            "layer graph four times, and compiled measured no faster than eager (bench/RESULTS.md) "
                            "while starting 24 s slower; --torch-compile compiles the layers around TE's GEMMs")
        return False
    why = capability.compile_off_reason(view, view.dims)
    if why is not None:
        view.notices.append(f"note: torch.compile is off by default here: {why}")
    return why is None


def tp_comm_overlap(view: Resolver) -> str | None:
    """Without the flag, reorder wherever it can run; the bare flag becomes the mode that runs here; none is off.
    Whether the asked mode runs here is rules._tp_comm_overlap's."""
    from megatron_ds.parallel.overlap import default_mode, resolve_mode

    asked = view.given("tp_comm_overlap")
    if asked is None:
        return default_mode(view.dims.tp, view.torch_compile)
    return resolve_mode(asked)


DERIVED: dict[str, Callable[[Resolver], Any]] = {
    **{_dest(flag): _required_positive(flag)
       for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")},
    **{_dest(flag): _positive(flag) for flag in ("--log-interval", "--eval-interval", "--recompute-num-layers",
                                                 "--train-samples")},
    "eval_iters": lambda view: at_least_zero("--eval-iters", view.given("eval_iters")),
    "ds_config_file": lambda view: load_ds_config(view.deepspeed_config) if view.deepspeed_config else None,
    "micro_batch_size": micro_batch_size,
    "global_batch_size": global_batch_size,
    "gradient_accumulation_steps": lambda view: accumulation_steps(view.global_batch_size, view.micro_batch_size,
                                                                   view.data_parallel_size),
    "zero_stage": zero_stage,
    "lr": lr,
    "recompute_granularity": lambda view: recompute(view)[0],
    "recompute_method": lambda view: recompute(view)[1],
    "sequence_parallel": sequence_parallel,
    "dims": dims,
    "world_size": lambda view: view.world,
    "data_parallel_size": lambda view: view.dims.dp,
    "train_iters": train_iters,
    "lr_decay_iters": lr_decay_iters,
    "lr_decay_samples": lr_decay_samples,
    "torch_compile": torch_compile,
    "tp_comm_overlap": tp_comm_overlap,
}
