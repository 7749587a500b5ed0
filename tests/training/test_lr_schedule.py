"""The LR schedule against Megatron-DeepSpeed's semantics: positions in samples or tokens, the rate of an
update taken before it, resume checks (--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ds.arguments.lr_schedule import LRSchedule, ScheduledLR, ScheduleMismatch, schedule_from
from tests.training.sections import sections


def test_warmup_then_linear_cosine_and_inverse_square_root_decay():
    lin = LRSchedule(max_lr=1.0, min_lr=0.1, warmup=10, decay=110, style="linear")
    assert lin.lr_at(0) == 0.0 and lin.lr_at(5) == pytest.approx(0.5) and lin.lr_at(10) == pytest.approx(1.0)
    assert lin.lr_at(60) == pytest.approx(0.1 + 0.5 * 0.9) and lin.lr_at(110) == pytest.approx(0.1)
    assert lin.lr_at(500) == pytest.approx(0.1)
    cos = LRSchedule(max_lr=1.0, min_lr=0.0, warmup=0, decay=100, style="cosine")
    assert cos.lr_at(0) == 1.0 and cos.lr_at(50) == pytest.approx(0.5)
    assert cos.lr_at(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    const = LRSchedule(max_lr=2.0, min_lr=0.0, warmup=4, decay=8, style="constant")
    assert const.lr_at(2) == pytest.approx(1.0) and const.lr_at(100) == 2.0
    isr = LRSchedule(max_lr=1.0, min_lr=0.01, warmup=4, decay=1000, style="inverse-square-root")
    assert isr.lr_at(16) == pytest.approx(0.5) and isr.lr_at(999) == pytest.approx(max(0.01, 2 / 999 ** 0.5))
    with pytest.raises(ValueError, match="unknown lr decay style 'exponential'"):
        LRSchedule(1.0, 0.0, 0, 10, style="exponential")


def test_the_update_uses_the_rate_before_it_and_resumes():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=99.0)
    sched = ScheduledLR(opt, LRSchedule(1.0, 0.0, warmup=8, decay=16, per_step=2))
    assert opt.param_groups[0]["lr"] == 0.0  # first update of a warmup: upstream's step(0)
    for _ in range(3):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.75)  # 4th update: position 6 of 8
    state = sched.state_dict()
    other = ScheduledLR(opt, LRSchedule(1.0, 0.0, warmup=8, decay=16, per_step=2))
    other.load_state_dict(state)
    assert other.get_lr() == [pytest.approx(0.75)] and other.schedule.position == 6


def _args(**kw):
    base = dict(global_batch_size=4, seq_length=64, lr=1e-3, min_lr=1e-5, lr_decay_style="cosine",
                lr_decay_iters=None, lr_decay_samples=None, lr_decay_tokens=None, lr_warmup_iters=0,
                lr_warmup_samples=0, lr_warmup_tokens=None, lr_warmup_fraction=None,
                override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)
    return SimpleNamespace(**{**base, **kw})


class UpstreamScheduler:
    """Megatron-DeepSpeed's scheduler as its documentation and training loop describe it, written for
    this test: num_steps counts samples (stepped by the global batch after each update, once with 0 at
    construction), num_tokens the consumed tokens; token flags override; a sample warmup followed by a
    token decay records the tokens consumed when the warmup ended."""

    def __init__(self, lr, min_lr, warmup_steps, decay_steps, style, decay_tokens=None, warmup_tokens=None):
        self.lr, self.min_lr, self.style = lr, min_lr, style
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_tokens, self.warmup_tokens = decay_tokens, warmup_tokens
        self.num_steps = self.num_tokens = 0

    def get_lr(self):
        if self.warmup_tokens is None:
            if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
                if self.num_steps == self.warmup_steps and self.decay_tokens is not None:
                    self.warmup_tokens = self.num_tokens
                return self.lr * self.num_steps / self.warmup_steps
        elif self.warmup_tokens > 0 and self.num_tokens <= self.warmup_tokens:
            return self.lr * self.num_tokens / self.warmup_tokens
        if self.style == "constant":
            return self.lr
        done, end = ((self.num_steps, self.decay_steps) if self.decay_tokens is None
                     else (self.num_tokens, self.decay_tokens))
        if done > end:
            return self.min_lr
        start = self.warmup_steps if self.decay_tokens is None else self.warmup_tokens
        ratio = (done - start) / (end - start)
        coeff = 1 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def rates(self, updates, gbs, seq):
        out = []
        for _ in range(updates):
            out.append(self.get_lr())  # the rate the coming update uses
            self.num_steps += gbs
            self.num_tokens += gbs * seq
        return out


@pytest.mark.parametrize("flags, upstream", [
    (dict(lr_decay_iters=10, lr_warmup_iters=2), dict(warmup_steps=8, decay_steps=40)),
    (dict(lr_decay_samples=14, lr_warmup_samples=1), dict(warmup_steps=1, decay_steps=14)),
    (dict(lr_decay_samples=30, lr_warmup_fraction=0.1, lr_decay_style="linear"),
     dict(warmup_steps=3.0, decay_steps=30)),
    (dict(lr_decay_samples=30, lr_warmup_samples=8, lr_decay_tokens=1600),
     dict(warmup_steps=8, decay_steps=30, decay_tokens=1600)),
    (dict(lr_decay_samples=30, lr_warmup_tokens=256, lr_decay_tokens=1600),
     dict(warmup_steps=0, decay_steps=30, decay_tokens=1600, warmup_tokens=256)),
], ids=["iterations", "samples", "fraction", "sample-warmup-token-decay", "tokens"])
def test_rates_equal_upstreams_update_by_update(flags, upstream):
    args = _args(**flags)
    schedule = schedule_from(sections(**vars(args)))
    ref = UpstreamScheduler(args.lr, args.min_lr, style=args.lr_decay_style, **upstream)
    expected = ref.rates(12, args.global_batch_size, args.seq_length)
    ours = []
    for _ in range(12):
        ours.append(schedule.current_lr())
        schedule.advance()
    assert ours == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert ours[0] == 0.0 and max(ours) <= args.lr


def test_resume_checks_the_schedule_shape_as_upstream():
    saved = LRSchedule(1e-3, 1e-5, warmup=8, decay=40, per_step=4, position=20).state_dict()
    with pytest.raises(ScheduleMismatch) as err:
        LRSchedule(2e-3, 1e-5, warmup=8, decay=80, per_step=4).load_state_dict(saved)
    message = str(err.value)
    assert "max_lr 0.001 in the checkpoint vs 0.002 from the flags" in message
    assert "decay 40 in the checkpoint vs 80" in message and "--override-opt_param-scheduler" in message
    flags = LRSchedule(2e-3, 1e-5, warmup=8, decay=80, per_step=4, on_resume="flags")
    flags.load_state_dict(saved)
    assert (flags.max_lr, flags.decay, flags.position) == (2e-3, 80, 20)
    ckpt = LRSchedule(2e-3, 1e-5, warmup=8, decay=80, per_step=4, on_resume="checkpoint")
    ckpt.load_state_dict(saved)
    assert (ckpt.max_lr, ckpt.decay, ckpt.position) == (1e-3, 40, 20)
    same = LRSchedule(1e-3, 1e-5, warmup=8, decay=40, per_step=4)
    same.load_state_dict(saved)
    assert same.position == 20


def test_checkpoints_from_before_the_sample_schedule_resume_at_their_step():
    old = {"step": 5, "max_lr": 1.0, "min_lr": 0.0, "warmup_steps": 2, "decay_steps": 10, "style": "linear"}
    schedule = LRSchedule(1.0, 0.0, warmup=8, decay=40, per_step=4)
    schedule.load_state_dict(old)
    assert schedule.position == 20
