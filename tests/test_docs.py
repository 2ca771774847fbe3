"""The README is a front door and the docs hold the rest: every relative link in them resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_resolves(document):
    links = relative_links(document)
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(link)
    assert not broken, f"{document.name}: broken links {broken}"


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad anchor](#nowhere)\n")
    assert relative_links(page) == ["#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"} and not (tmp_path / "missing.md").exists()


def test_the_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_every_benchmark_result_is_linked_from_a_document():
    """bench/results/ holds only results a document names (make bench's quick runs are not tracked)."""
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    unlinked = [
        path.name
        for path in sorted((REPO / "bench" / "results").iterdir())
        if path.name not in text and not path.name.startswith("quick")
    ]
    assert not unlinked, f"results no document names: {unlinked}"
