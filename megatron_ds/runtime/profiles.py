"""Site profiles: data files in, environment out (user values always win).

A profile is an INI file (configparser: no dependency on Python 3.10) under `cuda/profiles/` or
`rocm/profiles/` with these sections:

    [profile]   description, platform hints
    [detect]    priority = N; all = conditions that must all hold; any = of which one must hold
                (conditions: env:VAR, env:VAR=regex, host:regex, path:glob, file:glob=regex)
    [env]       VAR = value, set unless the user already set VAR
    [prepend]   VAR = dir[:dir], prepended to a path variable when the directory exists
    [libraries] name = lib1.so lib2.so: one of them must load (e.g. the libfabric NCCL plugin)
    [affinity]  cpus = one CPU list per local rank, or ccd_by_gcd + cores_per_ccd + reserve_first_core

Detection picks the matching profile with the highest priority; `generic` (priority 0) always matches.
"""

from __future__ import annotations

import configparser
import ctypes
import glob
import os
import re
import site
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ds import env_settings

PLATFORMS = ("cuda", "rocm")


class ProfileError(ValueError):
    """A profile name that does not exist, or a malformed profile file."""


@dataclass(frozen=True)
class Profile:
    name: str
    platform: str
    path: str
    description: str
    priority: int
    detect_all: tuple[str, ...]
    detect_any: tuple[str, ...]
    env: dict[str, str] = field(hash=False)
    prepend: dict[str, str] = field(hash=False)
    libraries: dict[str, tuple[str, ...]] = field(hash=False)
    cpus_by_local_rank: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Setting:
    """One variable and why it has its value."""

    name: str
    value: str
    why: str
    applied: bool  # False when the user's own value was kept


# ---------------------------------------------------------------- files

def profile_dirs(env: Mapping[str, str] = os.environ) -> list[Path]:
    """Where profiles live: $MDS_PROFILE_PATH, the source tree, then the installed data files."""
    dirs = [Path(p) for p in env_settings.PROFILE_PATH.get(env)]
    roots = [Path(__file__).resolve().parents[2], Path(sys.prefix) / "share" / "mds",
             Path(site.getuserbase()) / "share" / "mds"]  # source tree, pip install, pip install --user
    dirs += [root / platform / "profiles" for root in roots for platform in PLATFORMS]
    return [d for d in dirs if d.is_dir()]


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Linux CPU list syntax: `1-7,9` -> (1, 2, 3, 4, 5, 6, 7, 9)."""
    cpus: list[int] = []
    for item in text.split(","):
        low, _, high = item.strip().partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return tuple(cpus)


def _words(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _affinity(section: Mapping[str, str], where: str) -> tuple[tuple[int, ...], ...]:
    if "cpus" in section:
        return tuple(parse_cpu_list(item) for item in section["cpus"].split())
    if "ccd_by_gcd" in section:
        per_ccd = int(section.get("cores_per_ccd", "8"))
        skip = section.get("reserve_first_core", "false").lower() in ("1", "true", "yes")
        return tuple(tuple(range(ccd * per_ccd + skip, (ccd + 1) * per_ccd))
                     for ccd in map(int, section["ccd_by_gcd"].split()))
    if section:
        raise ProfileError(f"{where}: [affinity] needs 'cpus' or 'ccd_by_gcd'")
    return ()


def load_profile(path: Path) -> Profile:
    parser = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",), inline_comment_prefixes=None)
    parser.optionxform = str  # keep variable names' case
    try:
        parser.read(path)
        meta = dict(parser["profile"]) if parser.has_section("profile") else {}
        detect = dict(parser["detect"]) if parser.has_section("detect") else {}

        def section(name: str) -> dict[str, str]:
            return dict(parser[name]) if parser.has_section(name) else {}

        return Profile(
            name=path.stem, platform=path.parent.parent.name, path=str(path),
            description=meta.get("description", ""), priority=int(detect.get("priority", "0")),
            detect_all=_words(detect.get("all", "")), detect_any=_words(detect.get("any", "")),
            env=section("env"), prepend=section("prepend"),
            libraries={k: tuple(v.split()) for k, v in section("libraries").items()},
            cpus_by_local_rank=_affinity(section("affinity"), str(path)),
        )
    except (configparser.Error, ValueError) as err:
        raise ProfileError(f"profile {path}: {err}") from None


def all_profiles(env: Mapping[str, str] = os.environ) -> dict[str, Profile]:
    """Every profile by name; an earlier directory wins over a later one."""
    found: dict[str, Profile] = {}
    for directory in profile_dirs(env):
        for path in sorted(directory.glob("*.ini")):
            found.setdefault(path.stem, load_profile(path))
    return found


def get_profile(name: str, env: Mapping[str, str] = os.environ) -> Profile:
    profiles = all_profiles(env)
    if name not in profiles:
        raise ProfileError(f"--profile {name!r}: no such profile (known: {', '.join(sorted(profiles))})")
    return profiles[name]


# ---------------------------------------------------------------- detection

@dataclass(frozen=True)
class Probe:
    """What detection looks at: variables, host name and a filesystem root (tests point it at a tmp dir)."""

    env: Mapping[str, str]
    hostname: str
    root: str = "/"

    def _path(self, pattern: str) -> str:
        return os.path.join(self.root, pattern.lstrip("/"))

    def holds(self, condition: str) -> bool:
        kind, _, arg = condition.partition(":")
        if kind == "env":
            name, eq, pattern = arg.partition("=")
            return name in self.env and (not eq or re.search(pattern, self.env[name]) is not None)
        if kind == "host":
            return re.search(arg, self.hostname) is not None
        if kind == "path":
            return bool(glob.glob(self._path(arg)))
        if kind == "file":
            pattern, _, regex = arg.partition("=")
            for path in glob.glob(self._path(pattern)):
                try:
                    if re.search(regex, Path(path).read_text(errors="replace")):
                        return True
                except OSError:
                    continue
            return False
        raise ProfileError(f"unknown detect condition {condition!r} (use env:, host:, path: or file:)")


def matches(profile: Profile, probe: Probe) -> bool:
    return all(probe.holds(c) for c in profile.detect_all) and (
        not profile.detect_any or any(probe.holds(c) for c in profile.detect_any))


def detect(env: Mapping[str, str] = os.environ, hostname: str | None = None, root: str = "/",
           profiles: Mapping[str, Profile] | None = None) -> Profile:
    """The matching profile of highest priority (ties: the name first in alphabetical order)."""
    profiles = all_profiles(env) if profiles is None else profiles
    probe = Probe(env, hostname if hostname is not None else socket.gethostname(), root)
    candidates = [p for p in profiles.values() if matches(p, probe)]
    if not candidates:
        raise ProfileError(f"no profile matches this machine (searched {[str(d) for d in profile_dirs(env)]})")
    return sorted(candidates, key=lambda p: (-p.priority, p.name))[0]


def choose(name: str | None, env: Mapping[str, str] = os.environ) -> tuple[Profile, str]:
    """--profile, else $MDS_PROFILE, else detection; returns the profile and why it was chosen."""
    if name:
        return get_profile(name, env), "--profile"
    if env_settings.PROFILE.is_set(env):
        return get_profile(env_settings.PROFILE.get(env), env), env_settings.PROFILE.name
    return detect(env), "detected"


# ---------------------------------------------------------------- environment

def settings(profile: Profile, env: Mapping[str, str]) -> list[Setting]:
    """The variables the profile sets in `env`, each with its reason; user values are kept."""
    out: list[Setting] = []
    for name, value in profile.env.items():
        if name in env and env[name] != value:
            out.append(Setting(name, env[name], f"set by the user (profile {profile.name} would set {value!r})", False))
        else:
            out.append(Setting(name, value, f"profile {profile.name}", True))
    out.append(compile_cache(env))
    for name, dirs in profile.prepend.items():
        present = [d for d in dirs.split(os.pathsep) if d and os.path.isdir(d)]
        current = [d for d in env.get(name, "").split(os.pathsep) if d]
        missing = [d for d in present if d not in current]
        if missing:
            out.append(Setting(name, os.pathsep.join(missing + current), f"profile {profile.name} prepends "
                               f"{os.pathsep.join(missing)}", True))
    return out


COMPILE_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache(env: Mapping[str, str]) -> Setting:
    """Where torch.compile keeps the kernels it built: the user's TORCHINDUCTOR_CACHE_DIR, else
    ~/.cache/mds/torch-compile. torch's own default sits under /tmp: one node's, often wiped with the job, so a job
    resubmitted to other nodes compiled everything again (GPT-6.7B TP=2 on H200: first step 127 s cold, 8 s from
    the cache). A home directory is on the shared filesystem of most clusters and outlives the job; the ranks of a
    node share the one directory, and inductor writes each entry atomically."""
    if env.get(COMPILE_CACHE):
        return Setting(COMPILE_CACHE, env[COMPILE_CACHE], "set by the user", False)
    home = env.get("HOME") or os.path.expanduser("~")
    return Setting(COMPILE_CACHE, os.path.join(home, ".cache", "mds", "torch-compile"),
                   "mds default: compiled kernels kept across jobs and restarts (set it to a shared directory "
                   "where home is not shared)", True)


def apply(profile: Profile, env: dict[str, str]) -> list[Setting]:
    """Set the profile's variables in `env` (a dict or os.environ) and return what was decided."""
    decided = settings(profile, env)
    for setting in decided:
        if setting.applied:
            env[setting.name] = setting.value
    env[env_settings.PROFILE.name] = profile.name  # spawned ranks use the same profile without detecting again
    return decided


# ---------------------------------------------------------------- libraries and CPU binding

@dataclass(frozen=True)
class LibraryCheck:
    role: str
    candidates: tuple[str, ...]
    loaded: str | None  # path or name that loaded, None when none did
    errors: tuple[str, ...]


def _load(candidate: str, search: list[str]) -> tuple[str | None, str]:
    for directory in search:
        path = os.path.join(directory, candidate)
        if os.path.exists(path):
            try:
                ctypes.CDLL(path)
                return path, ""
            except OSError as err:
                return None, f"{path}: {err}"
    try:  # the dynamic loader's own search (ld.so.cache, default directories)
        ctypes.CDLL(candidate)
        return candidate, ""
    except OSError as err:
        return None, str(err)


def check_libraries(profile: Profile, env: Mapping[str, str]) -> list[LibraryCheck]:
    """Try to load each required library (any one of its candidates), searching LD_LIBRARY_PATH first."""
    search = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    search += ["/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    checks = []
    for role, candidates in profile.libraries.items():
        errors = []
        loaded = None
        for candidate in candidates:
            loaded, error = _load(candidate, search)
            if loaded:
                break
            errors.append(error)
        checks.append(LibraryCheck(role, candidates, loaded, tuple(errors)))
    return checks


def online_cpus() -> set[int]:
    try:
        return set(parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text().strip()))
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def cpus_for(profile: Profile, local_rank: int,
             env: Mapping[str, str] = os.environ) -> tuple[tuple[int, ...] | None, str]:
    """The CPU set of a local rank under this profile and why (None: leave the binding alone)."""
    if not env_settings.CPU_BIND.get(env):
        return None, f"{env_settings.CPU_BIND.name}=none"
    if not profile.cpus_by_local_rank:
        return None, f"profile {profile.name} has no CPU map"
    if local_rank >= len(profile.cpus_by_local_rank):
        return None, f"profile {profile.name} maps {len(profile.cpus_by_local_rank)} local ranks, not {local_rank}"
    cpus = profile.cpus_by_local_rank[local_rank]
    absent = sorted(set(cpus) - online_cpus())
    if absent:
        return None, f"profile {profile.name} CPU map names CPUs this machine lacks ({absent[:4]}...)"
    return cpus, f"profile {profile.name} CPU map, local rank {local_rank}"


def format_cpus(cpus) -> str:
    """(1, 2, 3, 5) -> '1-3,5'."""
    cpus = sorted(cpus)
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(parts)
