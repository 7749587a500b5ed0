"""The image flavours, one table (image_flavours.json next to this file): recipe, pin file, make target and
the components each flavour requires. Adding a flavour is one entry there (and its recipe and make target,
which tests/images checks against it). Standard library only: the lowest layer of the package reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Flavour:
    name: str
    recipe: str  # the Dockerfile, from the repository root
    pins: str  # the pin file whose KEY=VALUE lines the make target passes as --build-arg
    base_arg: str  # the build argument naming the base image (BASE_IMAGE=... on make overrides it)
    make: str  # the make target that builds it
    required: tuple[str, ...]  # doctor's checks that must pass in this image


_TABLE = json.loads(Path(__file__).with_name("image_flavours.json").read_text())
BASE_REQUIRED: tuple[str, ...] = tuple(_TABLE["required"])  # required in every image, and where none is known
FLAVOURS: dict[str, Flavour] = {
    name: Flavour(name, entry["recipe"], entry["pins"], entry["base_arg"], entry["make"],
                  (*BASE_REQUIRED, *entry["requires"]))
    for name, entry in _TABLE["flavours"].items()}
