"""The documentation holds together: a short README, `docs/<page>.md §N` references that name a real page and a
real numbered heading, no references to design notes outside the repository, and relative links that resolve.

Each check is a small function run on a planted bad case first (so it can fail), then on the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 300
SCANNED = ("gyre_slurm", "tests", "tools", "configs", "sbatch", "docs")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sql", ".sh", ".sbatch", ".toml", ".txt", ""}

# docs/<page>.md, then any §numbers that follow it: "§5.2", "§1.5, §6", "§2–3", "§1.5 / §6.3"; inside docs/ a page
# is also named alone ("algorithms.md §2.3"), which counts only with a §
_REF = re.compile(r"(docs/)?([A-Za-z0-9_-]+)\.md((?:\s*(?:,|/|and|\()?\s*§\s*\d+(?:\.\d+)*(?:[–-]\d+(?:\.\d+)*)?)*)")
_NUMBER = re.compile(r"§\s*(\d+(?:\.\d+)*)(?:[–-](\d+(?:\.\d+)*))?")
# design notes that live outside the repository: a reference to them is a dead end for a reader of a clone
_OUTSIDE = re.compile(r"(?:ALGORITHMS|DESIGN)(?:\.md|\s*§)|FIELD-NOTES|\.\./shared\b|(?<![\w.])seeds/")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def scanned_files() -> list[Path]:
    out = [REPO / "README.md"]
    for top in SCANNED:
        for p in sorted((REPO / top).rglob("*")):
            if p.is_file() and p.suffix in SUFFIXES and "fixtures" not in p.parts and "__pycache__" not in p.parts:
                out.append(p)
    return [p for p in out if p != Path(__file__).resolve()]  # this file plants bad cases on purpose


def too_long(text: str) -> bool:
    return len(text.splitlines()) > README_MAX_LINES


def headings(page: Path) -> set[str]:
    """The section numbers of a page's headings: '## 5.2 The simulator' and '## 5. Scheduling' give 5.2 and 5."""
    found = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            found.add(m.group(1))
    return found


def bad_section_refs(text: str, docs: Path = DOCS) -> list[str]:
    """Each `docs/<page>.md [§N…]` in text whose page is missing or has no heading numbered N."""
    bad = []
    for m in _REF.finditer(text):
        if not m.group(1) and not m.group(3):
            continue  # a bare file name without a section: README.md, TASK.md, …
        page = docs / f"{m.group(2)}.md"
        if not page.is_file():
            bad.append(f"{m.group(0).strip()}: no such page")
            continue
        have = headings(page)
        for n in _NUMBER.finditer(m.group(3)):
            for num in filter(None, n.groups()):
                if num not in have:
                    bad.append(f"{m.group(0).strip()}: {page.name} has no heading §{num}")
    return bad


def outside_refs(text: str) -> list[str]:
    return [m.group(0) for m in _OUTSIDE.finditer(text)]


def broken_links(text: str, base: Path) -> list[str]:
    """Relative markdown links (not URLs, not bare anchors) whose file does not exist, relative to base."""
    bad = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (base / path).exists():
            bad.append(target)
    return bad


def test_the_checks_fail_on_planted_bad_cases(tmp_path: Path) -> None:
    (tmp_path / "algorithms.md").write_text("# A\n\n## 5. Scheduling\n\n### 5.2 The simulator\n")
    assert bad_section_refs("see docs/algorithms.md §5.2 and docs/algorithms.md §5", tmp_path) == []
    assert bad_section_refs("see docs/algorithms.md §5.3", tmp_path) == [
        "docs/algorithms.md §5.3: algorithms.md has no heading §5.3"]
    assert bad_section_refs("(docs/algorithms.md §5.2, §9)", tmp_path) == [
        "docs/algorithms.md §5.2, §9: algorithms.md has no heading §9"]
    assert bad_section_refs("docs/algorithms.md §5–7", tmp_path) == ["docs/algorithms.md §5–7: algorithms.md has no "
                                                                     "heading §7"]
    assert bad_section_refs("see docs/nowhere.md", tmp_path) == ["docs/nowhere.md: no such page"]
    assert bad_section_refs("algorithms.md §5.2 in TASK.md; algorithms.md §4", tmp_path) == [
        "algorithms.md §4: algorithms.md has no heading §4"]
    assert outside_refs("the ratio (ALGORITHMS.md §1.5) and DESIGN.md §3; ../shared/FIELD-NOTES.md") == [
        "ALGORITHMS.md", "DESIGN.md", "../shared", "FIELD-NOTES"]
    assert outside_refs("ALGORITHMS §2.3, seeds/paper.md") == ["ALGORITHMS §", "seeds/"]
    assert outside_refs("docs/algorithms.md §1.5; the seeds' summaries") == []
    (tmp_path / "here.md").write_text("x")
    assert broken_links("[a](here.md) [b](here.md#x) [c](https://x.org) [d](#top) [e](gone.md)", tmp_path) == [
        "gone.md"]
    assert too_long("line\n" * (README_MAX_LINES + 1)) and not too_long("line\n" * README_MAX_LINES)


def test_the_readme_is_short() -> None:
    text = (REPO / "README.md").read_text()
    assert not too_long(text), f"README.md has {len(text.splitlines())} lines; move detail into docs/"


def test_every_section_reference_names_a_page_and_a_heading() -> None:
    bad = [f"{p.relative_to(REPO)}: {b}" for p in scanned_files() for b in bad_section_refs(p.read_text())]
    assert not bad, "\n".join(bad)
    # the references the code makes most are really there
    text = "\n".join(p.read_text() for p in scanned_files() if p.suffix == ".py")
    assert len(_REF.findall(text)) >= 40


def test_nothing_refers_to_notes_outside_the_repository() -> None:
    bad = [f"{p.relative_to(REPO)}: {b}" for p in scanned_files() for b in outside_refs(p.read_text())]
    assert not bad, "\n".join(bad)


def test_every_relative_link_resolves() -> None:
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    bad = [f"{p.relative_to(REPO)}: {b}" for p in pages for b in broken_links(p.read_text(), p.parent)]
    assert not bad, "\n".join(bad)
