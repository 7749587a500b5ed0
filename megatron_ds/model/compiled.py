"""torch.compile for the transformer layers, with a way out: a compile failure runs them eager.

Every layer's forward goes through one compiled graph (parameters are graph inputs), so a failure to compile it
is a failure for all layers: ``CompiledForward`` then logs one WARNING naming the cause and every layer of this
process runs its eager forward for the rest of the run (the same math: only the kernels differ). Compile errors
are what dynamo raises for them (BackendCompilerFailed wraps inductor's: no C compiler, no working triton, a
lowering error); an error of the computation itself (out of memory, a collective) is not caught.

The backward graph is lowered together with the forward (inductor otherwise waits for the first backward), so
its failure is caught here too, and the first call's wall time is the whole start-up cost of compiling:
``first_call_seconds()``, which the training loop prints once.
"""

from __future__ import annotations

import contextlib
import getpass
import importlib
import os
import sys
import tempfile
import time

import torch

from megatron_ds import compile_costs
from megatron_ds.env_settings import INDUCTOR_OPTIONS

_failure: str | None = None  # why compiling failed in this process (then everything runs eager)
_first_calls: dict[str, float] = {}  # what -> seconds of its first compiled call: tracing and lowering both graphs


def cache_dir() -> str:
    """Where inductor keeps compiled kernels between runs (TORCHINDUCTOR_CACHE_DIR, else torch's /tmp default): a
    run that finds its kernels there skips most of the first step's compiling. Torch has moved the function
    between releases; a torch where none of its homes has it gets torch's documented default, never an error
    (the caller only prints it)."""
    for home in ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils",
                 "torch._inductor.utils"):
        try:
            return importlib.import_module(home).cache_dir()
        except (ImportError, AttributeError):
            continue
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                      f"torchinductor_{getpass.getuser()}")


def compile_failure() -> str | None:
    """Why the layers run eager after asking for torch.compile, or None."""
    return _failure


def first_call_seconds() -> float | None:
    """Wall time of the first call of each compiled layer function (their compile time, plus one layer's work),
    summed; None before any."""
    return sum(_first_calls.values()) if _first_calls else None


# Dropout through ATen's kernel instead of inductor's in-kernel Philox: inductor draws one random number per element
# inside its fused residual/LayerNorm kernels, ATen's dropout kernel four per draw. On the default-flags GPT-1.3B step
# (one H200) ATen's is 0.9% faster (bench/RESULTS.md), and the compiled layers then draw exactly the
# masks of the eager layers.
LAYER_OPTIONS = {"fallback_random": True}


def compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when compiling fails (not the computation's own errors)."""
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


def describe_compile_error(err: BaseException) -> str:
    """One line for a log: the error's type and the first line of its message."""
    first_line = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first_line}"


def _lower_backward_now():
    """Lower the backward graph at the first forward (torch >= 2.8 has the switch; older ones lower it lazily)."""
    from torch._functorch import config

    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def _fall_back(err: BaseException) -> None:
    global _failure
    _failure = describe_compile_error(err)
    rank = ""
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        rank = f" (rank {torch.distributed.get_rank()})"
    print(f"mds: WARNING{rank}: torch.compile of the transformer layers failed ({_failure}); they run eager for "
          "the rest of this run", file=sys.stderr, flush=True)


class CompiledForward:
    """``fn`` through torch.compile (with LAYER_OPTIONS, then inductor ``options``, then MDS_INDUCTOR_OPTIONS:
    env_settings.INDUCTOR_OPTIONS); ``fn`` itself once compiling has failed in this process. ``what`` names the
    graph in the start-up line's compile costs."""

    def __init__(self, fn, options: dict | None = None, what: str = "layer graph"):
        self.eager = fn
        self.what = what
        self.compiled = None
        options = {**LAYER_OPTIONS, **(options or {}), **(INDUCTOR_OPTIONS.get() or {})}
        if _failure is None:
            try:
                self.compiled = torch.compile(fn, options=options)
            except Exception as err:  # noqa: BLE001 - e.g. a Python that this torch's dynamo does not support
                _fall_back(err)

    def __call__(self, *args):
        if _failure is not None or self.compiled is None:
            return self.eager(*args)
        timed = self.what not in _first_calls
        start = time.perf_counter()
        try:
            with _lower_backward_now():
                out = self.compiled(*args)
        except compile_errors() as err:
            _fall_back(err)
            return self.eager(*args)
        if timed:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            _first_calls[self.what] = time.perf_counter() - start
            compile_costs.record(self.what, _first_calls[self.what])
        return out
