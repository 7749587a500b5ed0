"""A non-finite training loss or gradient norm stops the run before anything is saved from it (Megatron-LM's
--check-for-nan-in-loss-and-grad, on by default; --no-check-for-nan-in-loss-and-grad trains on regardless).

Every step's loss and gradient norm are tested on the device, and the iteration of the first non-finite one is
kept there. The host reads that record only where the loop reads the device anyway: at each log line (after the
step timer has synchronised, so the read waits for nothing) and before every checkpoint save. Reading it after
each step would make the host wait for the GPU, which then idles while the next step is prepared. So a bad step
is acted on at the next log line, at the latest before the next save, and the message names the iteration it
happened at.

fp16's dynamic loss scaling skips a step whose scaled gradients overflow and lowers the scale: the norm of such a
step is the scaler's business, not a stop (its loss still is). bf16 and fp32 have no scaler to recover: a
non-finite norm there is a stop.
"""

from __future__ import annotations

import math
import os

import torch

from megatron_ds.checkpoint import CheckpointError, resolve

NAMES = ("lm loss", "grad norm")


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite: which one(s), at which iteration, read at which."""

    def __init__(self, what: list[str], iteration: int, read_at: int):
        self.what, self.iteration, self.read_at = what, iteration, read_at
        later = f", found at iteration {read_at}" if read_at != iteration else ""
        super().__init__(f"non-finite {' and '.join(what)} at iteration {iteration}{later}")


class NonFiniteWatch:
    """The first iteration with a non-finite loss and with a non-finite gradient norm (0: none yet), kept on the
    device by ``add`` after every step and read by ``check`` (a host read: log points and saves only)."""

    def __init__(self, device: torch.device, *, enabled: bool, loss_scaled: bool):
        self.enabled, self.loss_scaled = enabled, loss_scaled
        self.first = torch.zeros(len(NAMES), dtype=torch.int64, device=device)
        self.first_norm_on_host = 0  # where the optimizer reports its norm as a Python float

    def add(self, iteration: int, loss: torch.Tensor, grad_norm, skipped: bool) -> None:
        """Step ``iteration``'s mean loss (a device tensor) and gradient norm (device tensor, float or None);
        ``skipped``: the optimizer skipped this step (with fp16, the loss scaler's overflow)."""
        if not self.enabled:
            return
        if skipped and self.loss_scaled:
            grad_norm = None
        finite = [torch.isfinite(loss.detach()).reshape(())]
        if isinstance(grad_norm, torch.Tensor):
            finite.append(torch.isfinite(grad_norm.detach()).reshape(()).to(self.first.device))
        elif grad_norm is not None and not math.isfinite(grad_norm) and not self.first_norm_on_host:
            self.first_norm_on_host = iteration
        first = self.first[:len(finite)]
        first.masked_fill_(~torch.stack(finite) & (first == 0), iteration)

    def check(self, iteration: int) -> None:
        """Raise NonFiniteError when any step up to ``iteration`` had a non-finite loss or gradient norm."""
        if not self.enabled:
            return
        first = self.first.tolist()
        if self.first_norm_on_host:
            first[1] = min(x for x in (first[1], self.first_norm_on_host) if x)
        bad = [x for x in first if x]
        if bad:
            earliest = min(bad)
            raise NonFiniteError([name for name, x in zip(NAMES, first) if x == earliest], earliest, iteration)


def newest_checkpoint(save: str | None, load: str | None) -> str:
    """What a stopped run can resume from: the checkpoint `latest` names in --save (else --load)."""
    for flag, directory in (("--save", save), ("--load", load)):
        if not directory:
            continue
        try:
            found = resolve(os.path.abspath(directory))
        except CheckpointError as err:
            return f"the newest checkpoint is unknown: {err}"
        if found is not None:
            return f"the newest checkpoint is {found[1]}"
    return f"no checkpoint in {save} yet" if save else "nothing was saved (no --save given)"


def stop_message(err: NonFiniteError, save: str | None, load: str | None, exit_code: int) -> str:
    """The one line a non-finite stop prints: what and where, what was kept, the way out."""
    return (f"mds train: stopped: {err} (exit {exit_code}; no checkpoint was written after it); "
            f"{newest_checkpoint(save, load)}. Run again with a lower --lr (resuming: with "
            "--override-opt_param-scheduler) or gradient clipping (--clip-grad); "
            "--no-check-for-nan-in-loss-and-grad trains on regardless")
