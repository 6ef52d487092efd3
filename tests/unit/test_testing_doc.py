"""docs/testing.md's coverage map stays true: one row per row of the README's feature table,
each with multi-process tests, every file it names exists, and every test file is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MULTI_PROCESS = ("dist/", "faults/", "cli/", "integrations/", "examples/")
HARNESS_ROW = "(the test harness itself)"


def _table(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _coverage() -> dict[str, tuple[list[str], list[str]]]:
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = _table(text, "| README row |")
    return {
        row[0]: (re.findall(r"`([^`]+\.py)`", row[1]), re.findall(r"`([^`]+\.py)`", row[2]))
        for row in rows
    }


def test_every_readme_feature_row_is_mapped_to_multi_process_tests():
    readme = [row[0] for row in _table((ROOT / "README.md").read_text(), "| area |")]
    coverage = _coverage()
    assert sorted(set(coverage) - {HARNESS_ROW}) == sorted(readme)
    for row, (multi, _single) in coverage.items():
        assert multi, f"{row}: no multi-process test"
        assert all(f.startswith(MULTI_PROCESS) for f in multi), (row, multi)


def test_every_named_file_exists_and_every_test_file_is_named():
    named = {f for multi, single in _coverage().values() for f in (*multi, *single)}
    missing = sorted(f for f in named if not (ROOT / "tests" / f).is_file())
    assert not missing, f"docs/testing.md names files that do not exist: {missing}"
    files = {str(p.relative_to(ROOT / "tests")) for p in (ROOT / "tests").glob("*/test_*.py")}
    unnamed = sorted(files - named)
    assert not unnamed, f"test files docs/testing.md does not map to a feature: {unnamed}"
