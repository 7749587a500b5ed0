"""Slurm's compressed hostlist syntax, expanded in Python because images carry no `scontrol`.

`nid[001-004,007],gpu-a[01-02],gpu-b7` -> nid001 nid002 nid003 nid004 nid007 gpu-a01 gpu-a02 gpu-b7.
Zero padding is kept (`[08-10]` -> 08 09 10), a name may hold several bracket groups
(`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2), and order and duplicates are kept as Slurm gives them.
"""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    """A node list that is not valid Slurm hostlist syntax."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in hostlist {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def _expand_ranges(body: str, text: str) -> list[str]:
    """`001-004,007` -> ['001', '002', '003', '004', '007'] (width of the lower bound kept)."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(f"bad range {item!r} in hostlist {text!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise HostlistError(f"descending range {item!r} in hostlist {text!r}")
        width = len(low) if low.startswith("0") or len(low) == len(high) else 0
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def _expand_one(name: str, text: str) -> list[str]:
    """One comma-free entry, possibly with several bracket groups."""
    pieces = re.split(r"(\[[^\]]*\])", name)
    choices = [
        _expand_ranges(piece[1:-1], text) if piece.startswith("[") else [piece] for piece in pieces if piece
    ]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(text: str) -> list[str]:
    """All host names of a Slurm hostlist expression, in order."""
    text = text.strip()
    if not text:
        return []
    hosts: list[str] = []
    for entry in _split_top_level(text):
        hosts += _expand_one(entry, text)
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's `SLURM_STEP_TASKS_PER_NODE` form: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise HostlistError(f"bad tasks-per-node entry {item!r} in {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
