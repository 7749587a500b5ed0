"""Every MDS_* environment variable mds reads, defined once: name, type, default and why it exists.

Other modules never look an MDS_* name up themselves: they ask its setting here, e.g. ``PEAK_TFLOPS.get()``
(os.environ) or ``PEAK_TFLOPS.get(env)`` (a mapping of the caller's, as the launcher's pure functions take). A
setting returns its default when the variable is unset or empty, else the parsed value; a value it cannot parse
raises SettingError (a ValueError) that names the variable, the value and what was expected. Nothing is read at
import. Where the variable is set for child processes (the supervisor, the launcher), ``SETTING.name`` names it.

Only MDS_* variables live here: those of other tools (RANK, SLURM_*, NCCL_*, TORCHINDUCTOR_*, ...) are read
where their concern lives (runtime/discovery.py, runtime/profiles.py). This module imports the standard library
and the image flavour table only, so any layer of the package may ask it. tests/test_env_settings.py fails when
another module of the package spells an MDS_* name itself, or mentions one not defined here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from megatron_ds.image_flavours import FLAVOURS

T = TypeVar("T")


class SettingError(ValueError):
    """A malformed MDS_* value; the message names the variable, its value and what it must be."""

    def __init__(self, name: str, value: str, problem: str):
        self.name, self.value, self.problem = name, value, problem
        super().__init__(f"{name}={value!r} {problem}")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One MDS_* variable: ``parse`` turns its text into the value (ValueError saying what it must be when it
    cannot), ``default`` stands for unset or empty, ``kind`` says the accepted form in words, ``doc`` why it
    exists."""

    name: str
    kind: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The value in ``env`` (default: os.environ, read now)."""
        raw = (os.environ if env is None else env).get(self.name, "")
        if raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as err:
            raise SettingError(self.name, raw, str(err)) from None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether ``env`` (default: os.environ) gives the variable a non-empty value."""
        return (os.environ if env is None else env).get(self.name, "") != ""


# ---------------------------------------------------------------- parsers: text -> value, or ValueError(what)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _text(raw: str) -> str:
    return raw


def _flag(raw: str) -> bool:
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError("must be 1 or 0 (or true/false, yes/no, on/off)")


def _cpu_bind(raw: str) -> bool:
    """``none`` (the documented spelling) or any false word turns the binding off."""
    return False if raw.strip().lower() == "none" else _flag(raw)


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("must be a number") from None


def _seconds(raw: str) -> float:
    value = _number(raw)
    if not value >= 0:
        raise ValueError("must be a number of seconds >= 0")
    return value


def _positive_number(raw: str) -> float:
    value = _number(raw)
    if not value > 0:
        raise ValueError("must be a number > 0")
    return value


def _list(separator: str) -> Callable[[str], tuple[str, ...]]:
    def parse(raw: str) -> tuple[str, ...]:
        return tuple(part for part in raw.split(separator) if part)

    return parse


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return raw

    return parse


def json_object(raw: str) -> dict:
    """A JSON object, e.g. '{"fallback_random": true}'."""
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object of inductor config names")
    return value


def _rank_seconds(raw: str) -> tuple[int, float]:
    try:
        rank, seconds = raw.split(":")
        return int(rank), float(seconds)
    except ValueError:
        raise ValueError("must be RANK:SECONDS, e.g. 1:0.2") from None


# ---------------------------------------------------------------- the variables

# -- launch and site (runtime/)
PROFILE: Setting[str | None] = Setting(
    "MDS_PROFILE", "profile name", None, _text,
    doc="the site profile (NCCL/RCCL environment, CPU binding) when --profile is not given, instead of detecting "
        "one; the launcher sets it for the ranks it spawns so that they do not detect again")
PROFILE_PATH: Setting[tuple[str, ...]] = Setting(
    "MDS_PROFILE_PATH", "directories, os.pathsep-separated", (), _list(os.pathsep),
    doc="more directories of site profiles, searched before the source tree's and the installed ones")
CPU_BIND: Setting[bool] = Setting(
    "MDS_CPU_BIND", "none|0|1", True, _cpu_bind,
    doc="none (or 0) turns off the profile's CPU binding of the ranks, for sites whose scheduler binds them itself")
RANK_LD_PRELOAD: Setting[tuple[str, ...]] = Setting(
    "MDS_RANK_LD_PRELOAD", "libraries, colon-separated", (), _list(":"),
    doc="libraries preloaded into training ranks only, ahead of the user's LD_PRELOAD (the MS-AMP image's "
        "libmsamp_dist.so, MSCCL's libnccl.so), so tools and the launcher itself run without them")
SUPERVISED: Setting[bool] = Setting(
    "MDS_SUPERVISED", "0|1", False, _flag,
    doc="set by the launcher in the ranks it spawns: their launcher flags were applied already (internal)")
STARTED_AT: Setting[float | None] = Setting(
    "MDS_STARTED_AT", "seconds since the epoch", None, _number,
    doc="when the user's `entrypoint` command started (an in-job restart: when the launcher started the ranks "
        "again); set by the first mds process, inherited by its ranks, whose start-up line counts from it "
        "(internal)")
SPAWNED_AT: Setting[float | None] = Setting(
    "MDS_SPAWNED_AT", "seconds since the epoch", None, _number,
    doc="set by the node supervisor when it starts the ranks: their start-up line splits the wait into the "
        "launcher's part and the rank's own (internal)")
WATCHDOG_DIR: Setting[str | None] = Setting(
    "MDS_WATCHDOG_DIR", "directory", None, _text,
    doc="set by the node supervisor: where each rank writes its progress and stacks; unset, a rank watches "
        "itself (internal)")
TEST_SLOW_RANK: Setting[tuple[int, float] | None] = Setting(
    "MDS_TEST_SLOW_RANK", "RANK:SECONDS", None, _rank_seconds,
    doc="test hook: that rank sleeps SECONDS per step in its data path, to make a straggler")
TEST_SLOW_SAVE: Setting[float] = Setting(
    "MDS_TEST_SLOW_SAVE", "seconds", 0.0, _seconds,
    doc="test hook: a save sleeps SECONDS after writing each checkpoint file, so a test can kill it mid-write")
PATCH_MANIFEST: Setting[str | None] = Setting(
    "MDS_PATCH_MANIFEST", "file", None, _text,
    doc="the image's record of the patches applied at build (set by the image recipes), printed by "
        "`entrypoint doctor`; unset, doctor looks at the default path")
IMAGE_FLAVOUR: Setting[str] = Setting(
    "MDS_IMAGE_FLAVOUR", "|".join(FLAVOURS), "", _text,
    doc="which image this is (set by the image recipes): the requirements `entrypoint doctor --strict` enforces "
        "by default; an unknown name counts as unset")

# -- training (training/)
SIGNAL_GRACE: Setting[float] = Setting(
    "MDS_SIGNAL_GRACE", "seconds", 300.0, _seconds,
    doc="with train --exit-signal-handler: seconds the supervisor gives the ranks after forwarding a TERM, so "
        "that they can finish the step and save, before it kills them")
PEAK_TFLOPS: Setting[float | None] = Setting(
    "MDS_PEAK_TFLOPS", "TFLOP/s", None, _positive_number,
    doc="the device's dense peak for MFU where --peak-tflops is not given (devices the table does not know, CPU)")

# -- model and parallel layers (model/, parallel/)
INDUCTOR_OPTIONS: Setting[dict | None] = Setting(
    "MDS_INDUCTOR_OPTIONS", "JSON object", None, json_object,
    doc="extra inductor config for the compiled layers (applied last), for trying inductor switches that have no "
        "TORCHINDUCTOR_ variable, e.g. '{\"fallback_random\": false}'")
TP_COLLECTIVES: Setting[str] = Setting(
    "MDS_TP_COLLECTIVES", "functional|inplace", "", _choice("functional", "inplace"),
    doc="forces one kind of TP collective everywhere (default: torch's functional ones inside compiled graphs, "
        "c10d's in eager code); inplace refuses compiling TP > 1 (pytorch#180642); for tests and "
        "bench/compile_tp_probe.py. Read at the first collective of the process")
ALLOW_TP_COMPILE: Setting[bool] = Setting(
    "MDS_ALLOW_TP_COMPILE", "0|1", False, _flag,
    doc="1 compiles TP > 1 layers even with MDS_TP_COLLECTIVES=inplace, to reproduce torch's bug "
        "(bench/compile_tp_probe.py)")
FUSED_CROSS_ENTROPY: Setting[bool | None] = Setting(
    "MDS_FUSED_CROSS_ENTROPY", "0|1", None, _flag,
    doc="0 turns the compiled (fused) cross-entropy kernels off, 1 forces them (CPU tests); unset: on with CUDA")

ALL: tuple[Setting, ...] = (PROFILE, PROFILE_PATH, CPU_BIND, RANK_LD_PRELOAD, SUPERVISED, STARTED_AT, SPAWNED_AT,
                            WATCHDOG_DIR,
                            TEST_SLOW_RANK, TEST_SLOW_SAVE, PATCH_MANIFEST, IMAGE_FLAVOUR, SIGNAL_GRACE, PEAK_TFLOPS,
                            INDUCTOR_OPTIONS, TP_COLLECTIVES, ALLOW_TP_COMPILE, FUSED_CROSS_ENTROPY)


def table() -> str:
    """One line per variable: name, accepted form, default, why (for the README and `--help` texts)."""
    return "\n".join(f"{s.name} ({s.kind}; default {s.default!r}): {s.doc}" for s in ALL)
