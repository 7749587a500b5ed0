"""The README is the newcomer's quick start and map, docs/ the manual: both must stay true to the tree.

Nothing tracked may point outside the repository (a reader of the repository has only the repository), the
README starts with the two commands a fresh machine needs, every relative link resolves, the map names every
top-level path and every package of megatron_ds, and every MDS_* variable the code reads is listed.
The variables are found in the code each time, so a new or renamed one fails here until the README says it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300
# places outside the repository that once leaked into it: shared notes beside the checkout (spelled in two
# pieces, so that this file does not match itself)
OUTSIDE = ("../" + "shared", "/wor" + "k/shared")
# where the package and its command read their environment; the README lists every MDS_* found there
CODE = ("megatron_ds", "entrypoint.py", "Dockerfile", "docker", "apptainer", "Makefile", "scripts")
VARIABLE = re.compile(r"\bMDS_[A-Z0-9_]*[A-Z0-9]\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SKIPPED_DIRS = {".git", ".venv", ".venv-torch21", ".cache", ".pytest_cache", "data", "runs", "build", "dist",
                "__pycache__"}


def tracked_files() -> list[Path]:
    """git's tracked files; without git (a copy of the tree), every file outside the build and data dirs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        names = [name for name in out.decode().split("\0") if name]
        if names:
            return [ROOT / name for name in names if (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    return [path for path in ROOT.rglob("*")
            if path.is_file() and not any(part in SKIPPED_DIRS or part.endswith(".egg-info")
                                          for part in path.relative_to(ROOT).parts[:-1])]


def code_files() -> list[Path]:
    files = []
    for name in CODE:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix != ".pyc"]
    return files


def test_nothing_tracked_points_outside_the_repository():
    leaks = []
    for path in tracked_files():
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        leaks += [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
                  for number, line in enumerate(text.splitlines(), 1) if any(o in line for o in OUTSIDE)]
    assert not leaks, "files point outside the repository (only the repository travels):\n" + "\n".join(leaks)


# How the tree was made is git's to tell, not the tree's: work-session numbers, the GPUs and tools it was made
# with, the paths of the machine it was made on. Each pattern is spelled so that it does not match itself.
HISTORY = re.compile(r"\bsessions?[ -]\d+|\blent\b|device\smachine|fetch\stool|session\sdiary|/wor[k]/|/roo[t]/out\b",
                     re.I)
# bench/results holds the records as they were written (their commands as run); their names say what they hold
RECORDS = "bench/results/"
DATED_RECORD = re.compile(r"_s\d{1,2}[a-z]?(_\d+)?\.json$")


def test_nothing_tracked_speaks_of_how_it_was_made():
    found = []
    for path in tracked_files():
        name = path.relative_to(ROOT).as_posix()
        if name.startswith(RECORDS):
            found += [f"{name}: named for when it ran"] if DATED_RECORD.search(name) else []
            continue
        text = path.read_text(errors="ignore")
        found += [f"{name}:{number}: {line.strip()[:100]}" for number, line in enumerate(text.splitlines(), 1)
                  if HISTORY.search(line)]
    assert not found, "say what is true now (history belongs in git):\n" + "\n".join(found)


def test_the_history_patterns_find_what_they_are_for():
    # spelled in pieces, so that this file does not match itself
    for text in ("measured in sess" "ion 14", "the sess" "ion-13 profile", "no second GPU is l" "ent", "the device "
                 "machine", "the fetch " "tool made", "default /wor" "k/.mirror", "/roo" "t/out/ab"):
        assert HISTORY.search(text), text
    for text in ('scope="session"', "its own session (process group)", "equivalent", "/root/.cache/mds"):
        assert not HISTORY.search(text), text
    assert DATED_RECORD.search("bench/results/dp2_s26.json") and not DATED_RECORD.search("gpt1_3b_s2048_mbs16.json")


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move details to docs/"
    assert lines[0].startswith("# "), "README.md starts with its title"
    body = [line for line in lines[1:] if line.strip()]
    assert body[0].startswith("```"), "the first thing after the title is the commands' code block"
    commands = [line.split("#")[0].strip() for line in body[1:3]]
    assert commands == ["make demo", "make test"], f"README.md must start with make demo, make test: {commands}"


@pytest.mark.parametrize("document", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = (document.parent / target.split("#")[0]).resolve()
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: links to nothing in the repository: {broken}"


def test_readme_links_every_document():
    text = README.read_text()
    missing = [doc.name for doc in DOCS if f"(docs/{doc.name})" not in text]
    assert not missing, f"README.md does not link docs/{missing}"


def test_readme_lists_every_mds_variable_the_code_reads():
    found: dict[str, str] = {}
    for path in code_files():
        for name in VARIABLE.findall(path.read_text(errors="ignore")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    assert found, "no MDS_* variable found in the code: the search is broken"
    section = README.read_text().split("## Environment variables", 1)
    assert len(section) == 2, "README.md has no '## Environment variables' section"
    listed = set(re.findall(r"^- `(MDS_[A-Z0-9_]+)`(?:, `(MDS_[A-Z0-9_]+)`)?:", section[1].split("\n## ")[0], re.M))
    listed = {name for pair in listed for name in pair if name}
    missing = {name: where for name, where in sorted(found.items()) if name not in listed}
    assert not missing, f"README.md '## Environment variables' lacks (variable: read in): {missing}"


def test_readme_lists_only_variables_that_exist():
    """A variable the code no longer reads must leave the list too (searched in every tracked file but the docs)."""
    text = README.read_text().split("## Environment variables", 1)[1].split("\n## ")[0]
    listed = set(re.findall(r"`(MDS_[A-Z0-9_]+)`", text))
    used: set[str] = set()
    for path in tracked_files():
        if path.suffix != ".md":
            used |= set(VARIABLE.findall(path.read_text(errors="ignore")))
    assert listed <= used, f"README.md lists variables nothing reads: {sorted(listed - used)}"


def test_readme_map_names_every_top_level_path_and_package():
    text = README.read_text().split("## Where things are", 1)
    assert len(text) == 2, "README.md has no '## Where things are' section"
    named = set(re.findall(r"^\| ([^|]+) \|", text[1].split("\n## ")[0], re.M))
    named = {word.strip("`/ ") for cell in named for word in cell.split(",")}
    top = {path.relative_to(ROOT).parts[0] for path in tracked_files()}
    packages = {f"megatron_ds/{path.parent.relative_to(ROOT / 'megatron_ds')}"
                for path in (ROOT / "megatron_ds").rglob("__init__.py") if path.parent != ROOT / "megatron_ds"}
    missing = sorted((top | packages) - named)
    assert not missing, f"README.md's map ('## Where things are') has no line for: {missing}"
