"""MS-AMP (``msamp``): the MS-AMP image's engine, levels O1/O2/O3. Selection and validation only.

Selected by --msamp (MS-AMP's Megatron-DeepSpeed patch) or --fp8-engine msamp. MS-AMP keeps FP8
weights and optimizer state on GPUs without FP8 GEMMs too (A100: higher-precision GEMMs, as it
documents), so it is not refused there. mds does not drive MS-AMP yet (``msamp.nn.LinearReplacer`` on
the LocalGEMMs, ``msamp.optim.LBAdamW`` for O2, MS-AMP's DeepSpeed integration for O3): until it does,
a run that selects it is refused at validation with the reason.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from megatron_ds.precision.fp8 import FP8Engine


def installed() -> bool:
    return importlib.util.find_spec("msamp") is not None


class MSAMPEngine(FP8Engine):
    name = "msamp"
    needs_fp8_gemm = False

    def missing(self) -> str | None:
        if not installed():
            return "MS-AMP is not installed (msamp is not importable); it ships in the MS-AMP image"
        return ("MS-AMP is installed, but mds does not drive it yet (FP8 through MS-AMP is planned, issue 14); "
                "use --fp8-engine torchao on a GPU with FP8 matrix multiplies")

    def convert(self, model: nn.Module) -> nn.Module:
        raise RuntimeError(self.missing())

    def describe(self) -> str:
        return f"msamp (MS-AMP {self.options.msamp_opt_level})"
