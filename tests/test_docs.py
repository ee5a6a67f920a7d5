"""The docs stay a dashboard and their links resolve (plain file reads, no imports of dayzero)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
MAX_BENCHMARKS_BYTES = 25 * 1024
DASHBOARD_COLUMNS = ("what", "device", "date", "command", "ours", "baseline", "roofline", "ratio")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", BENCHMARKS, *sorted((ROOT / "docs").glob("*.md"))]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def header_cells(line: str) -> list[str]:
    return [cell.strip().lower() for cell in line.strip().strip("|").split("|")]


def heading_anchors(text: str) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    anchors: set[str] = set()
    for line in text.splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def test_benchmarks_is_small():
    size = BENCHMARKS.stat().st_size
    assert size < MAX_BENCHMARKS_BYTES, (
        f"BENCHMARKS.md is {size} bytes, over {MAX_BENCHMARKS_BYTES}: it is a dashboard of current numbers; "
        "move run diaries and lost experiments to docs/kernels-notes.md")


def test_benchmarks_starts_with_the_dashboard_table():
    lines = [line for line in BENCHMARKS.read_text(encoding="utf-8").splitlines() if line.strip()]
    if lines and lines[0].startswith("# "):
        lines = lines[1:]  # the title
    assert len(lines) >= 3, "BENCHMARKS.md has no table"
    assert lines[0].startswith("|"), f"BENCHMARKS.md must start with a table, starts with {lines[0][:80]!r}"
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[1].strip()), f"not a table separator: {lines[1][:80]!r}"
    assert lines[2].startswith("|"), "the first table has no rows"
    cells = header_cells(lines[0])
    for column in DASHBOARD_COLUMNS:
        assert any(cell.startswith(column) for cell in cells), f"the first table lacks column {column!r}: {cells}"


@pytest.mark.parametrize("doc", doc_files(), ids=shown)
def test_relative_links_resolve(doc: Path):
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no file {shown(dest)})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{shown(doc)}: broken links: {broken}"
