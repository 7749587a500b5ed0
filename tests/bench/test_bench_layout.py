"""bench/ stays a harness a newcomer can read: a few stages named for what they measure, each reproducing a table of
bench/RESULTS.md that cites it, every cited record present and every record cited, and few files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
MAX_STAGES = 21
MAX_FILES = 60
MAX_RESULTS_LINES = 420


def stages() -> list[tuple[str, str]]:
    """(name, the comment on its definition line) for each `stage_NAME() {` of device.sh, in order."""
    text = (BENCH / "device.sh").read_text()
    return re.findall(r"^stage_(\w+)\(\) \{(.*)$", text, re.M)


def hand_written() -> str:
    """RESULTS.md without the block report.py generates."""
    text = (BENCH / "RESULTS.md").read_text()
    return text[:text.index("<!-- results:begin -->")]


def table_rows(text: str) -> list[dict[str, str]]:
    """Every row of every Markdown table, as header -> cell."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("- "):
            rows.append(dict(zip(header, cells)))
    return rows


def test_stages_are_few_unique_and_each_says_what_it_measures():
    found = stages()
    names = [name for name, _ in found]
    assert 0 < len(names) <= MAX_STAGES, names
    assert len(names) == len(set(names)), f"a stage defined twice: {sorted(n for n in names if names.count(n) > 1)}"
    for name, comment in found:
        assert re.fullmatch(r"  # \S.{10,}", comment), f"stage {name}: no one-line comment on its definition"
        when = re.search(r"(^|_)(s\d+[a-z]*|session\w*|call\d*)($|_)|\d(b|c|end|final)$", name)
        assert not when, f"stage {name} is named for when it ran, not for what it measures"


def test_every_stage_is_cited_by_results_md_and_results_md_cites_no_other():
    text = hand_written()
    names = {name for name, _ in stages()}
    for name in names:
        assert f"`{name}`" in text or f"device.sh {name}" in text, f"stage {name} reproduces no table of RESULTS.md"
    cited = set(re.findall(r"bash bench/device\.sh (\w+)", text)) | {
        row["stage"].strip("`") for row in table_rows(text) if "stage" in row and "what it measures" in row}
    assert cited <= names, f"RESULTS.md cites stages device.sh lacks: {sorted(cited - names)}"


def test_every_record_cited_exists_and_every_record_is_cited():
    text = hand_written()
    records = {path.name for path in (BENCH / "results").iterdir() if path.is_file()}
    cited = set()
    for row in table_rows(text):
        cell = row.get("record") or row.get("records")
        if cell:
            names = re.findall(r"`([^`]+)`", cell)
            assert names, f"a row cites no record: {row}"
            cited |= {name if name.endswith((".json", ".jsonl", ".log", ".txt")) else f"{name}.json" for name in names}
    assert cited <= records, f"RESULTS.md cites records bench/results lacks: {sorted(cited - records)}"
    assert records <= cited, f"records no table cites (delete them, or cite them): {sorted(records - cited)}"


def test_results_md_is_short_and_keeps_the_generated_block():
    text = (BENCH / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= MAX_RESULTS_LINES
    assert text.count("<!-- results:begin -->") == text.count("<!-- results:end -->") == 1
    assert not re.search(r"^#+ .*\bsession \d", text, re.M), "a section titled by session: history belongs in git"


OUTSIDE = ("../" + "shared", "/wor" + "k/shared")  # spelled in two parts, so this file does not match itself


def test_bench_has_few_tracked_files_and_nothing_outside_the_repository():
    listed = subprocess.run(["git", "ls-files", "bench"], cwd=REPO, capture_output=True, text=True, check=True)
    files = listed.stdout.split()
    assert 0 < len(files) <= MAX_FILES, f"{len(files)} tracked files in bench/"
    for name in files:
        if name.endswith((".py", ".sh")):
            source = (REPO / name).read_text()
            assert not any(outside in source for outside in OUTSIDE), name
            assert ".whl/reference_gpt.py" not in source, name  # the reference is bench/reference_gpt.py


def test_make_bench_runs_a_stage_and_its_comment_lists_them_all():
    text = (REPO / "Makefile").read_text()
    default = re.search(r"^BENCH_STAGES \?= (\S+)$", text, re.M).group(1)
    names = [name for name, _ in stages()]
    assert default in names
    comment = " ".join(re.search(r"((?:^#.*\n)+)BENCH_STAGES", text, re.M).group(1).split())
    for name in names:
        assert re.search(rf"\b{name}\b", comment), f"the Makefile's bench comment does not list {name}"
