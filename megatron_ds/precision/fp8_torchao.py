"""torchao float8 training (``torchao.float8``): dynamic scaling, tensorwise (default) or rowwise.

``convert_to_float8_training`` swaps ``nn.Linear`` modules for its ``Float8Linear``; the module filter
admits only our local GEMMs, so the output head and everything outside the transformer layers stay in
high precision. The weight Parameter objects move to the new module unchanged (their TP attributes
too), so the optimizer, DeepSpeed and checkpoints see the same parameters under the same names, and
there is no FP8 state to save: dynamic scaling computes each scale from the current tensor.
Fastest under torch.compile (--torch-compile), which fuses the amax and cast kernels; on CUDA inductor also
tunes those fused kernels (coordinate descent), which they need more than bf16's (``tune_fused_kernels``).
"""

from __future__ import annotations

import os

from torch import nn

from megatron_ds.precision.fp8 import FP8Engine, local_gemms

# Delayed-scaling flags (Transformer Engine's recipe); torchao computes each scale from the current tensor.
DELAYED_SCALING_FLAGS = ("--fp8-margin", "--fp8-interval", "--fp8-amax-history-len", "--fp8-amax-compute-algo")


TUNING_VARIABLE = "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"


def tune_fused_kernels() -> bool:
    """Inductor's coordinate-descent tuning on, unless the user set TORCHINDUCTOR_COORDINATE_DESCENT_TUNING (theirs
    wins). The amax/cast kernels torchao adds around each GEMM ran ~3x off memory bandwidth; tuned, GPT-1.3B FP8 is
    1.8% faster on one H200 (bf16 unchanged; bench/RESULTS.md), for ~45 s more compiling once per kernel cache."""
    import torch

    if TUNING_VARIABLE in os.environ or not torch.cuda.is_available():
        return False
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = True
    return True


class TorchaoEngine(FP8Engine):
    name = "torchao"

    def __init__(self, options):
        super().__init__(options)
        self.tuned = False  # whether convert() turned inductor's kernel tuning on

    @property
    def recipe(self) -> str:
        """torchao scales from each tensor's current values: delayed (Megatron-LM's default name) runs tensorwise."""
        return "rowwise" if self.options.recipe == "rowwise" else "tensorwise"

    def missing(self) -> str | None:
        try:
            import torchao.float8  # noqa: F401
        except Exception as exc:  # ImportError, or a torchao built for another torch failing at import
            return (f"torchao's float8 training is not importable ({type(exc).__name__}: {exc}); install it "
                    "with `pip install megatron_ds[fp8]` (torchao, pure Python)")
        return None

    def config(self):
        """torchao's Float8LinearConfig for the recipe and --fp8-format."""
        import torch
        from torchao.float8 import CastConfig, Float8LinearConfig

        if self.recipe == "rowwise":  # torchao's recipe: e4m3 everywhere, power-of-two scales
            return Float8LinearConfig.from_recipe_name("rowwise")
        if self.options.format == "e4m3":  # gradients in e4m3 too (hybrid: torchao's default, e5m2)
            return Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
        return Float8LinearConfig()

    def convert(self, model: nn.Module, state=None) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        self.tuned = tune_fused_kernels()
        chosen = {id(m) for m in local_gemms(model).values()}
        return convert_to_float8_training(model, config=self.config(),
                                          module_filter_fn=lambda module, fqn: id(module) in chosen)

    def describe(self) -> str:
        grads = "e4m3" if self.recipe == "rowwise" or self.options.format == "e4m3" else "e5m2"
        tuned = ", inductor tunes its fused kernels" if self.tuned else ""
        return f"torchao (float8 {self.recipe} dynamic scaling, e4m3 forward / {grads} gradients{tuned})"

    def notes(self, given: set[str]) -> list[str]:
        ignored = [flag for flag in DELAYED_SCALING_FLAGS if flag in given]
        notes = []
        if ignored:
            notes.append(f"note: {', '.join(ignored)} accepted and ignored: torchao scales each tensor dynamically "
                         "(these set Transformer Engine's delayed scaling)")
        if self.options.recipe == "delayed":
            notes.append("note: --fp8-recipe delayed: torchao has no delayed scaling; it scales each tensor from its "
                         "current values (tensorwise). Delayed scaling runs with --fp8-engine te")
        if self.recipe == "rowwise" and self.options.format == "hybrid" and "--fp8-hybrid" in given:
            notes.append("note: --fp8-recipe rowwise uses torchao's rowwise recipe: e4m3 gradients too")
        return notes
