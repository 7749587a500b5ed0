"""torchao float8 training (``torchao.float8``): dynamic scaling, tensorwise (default) or rowwise.

``convert_to_float8_training`` swaps ``nn.Linear`` modules for its ``Float8Linear``; the module filter
admits only our local GEMMs, so the output head and everything outside the transformer layers stay in
high precision. The weight Parameter objects move to the new module unchanged (their TP attributes
too), so the optimizer, DeepSpeed and checkpoints see the same parameters under the same names, and
there is no FP8 state to save: dynamic scaling computes each scale from the current tensor.
Fastest under torch.compile (--torch-compile), which fuses the amax and cast kernels; inductor can also tune
those fused kernels (coordinate descent), at a start-up cost that does not pay back by default
(``fused_kernels_tuned``).
"""

from __future__ import annotations

from torch import nn

from megatron_ds.precision.fp8 import FP8Engine, local_gemms

# Delayed-scaling flags (Transformer Engine's recipe); torchao computes each scale from the current tensor.
DELAYED_SCALING_FLAGS = ("--fp8-margin", "--fp8-interval", "--fp8-amax-history-len", "--fp8-amax-compute-algo")


def fused_kernels_tuned() -> bool:
    """Whether inductor tunes its fused kernels (coordinate descent): off unless the user sets
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1, which torch reads itself. Tuning makes GPT-1.3B FP8 about 2% faster
    on one H200 but took it 283 s to its first step instead of 38 s with a cold compile cache (bench/RESULTS.md,
    start-up): paid back only after ~16,000 steps, so a start (and every restart on a new node) does not pay it."""
    import torch._inductor.config as inductor

    return bool(inductor.coordinate_descent_tuning)


class TorchaoEngine(FP8Engine):
    name = "torchao"

    def __init__(self, options):
        super().__init__(options)
        self.tuned = False  # whether inductor tunes its fused kernels (the user's TORCHINDUCTOR_ variable)

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

        self.tuned = fused_kernels_tuned()
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
