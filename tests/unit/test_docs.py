"""The README stays a front door and the docs stay connected: its length, CI's test command,
and every relative link and anchor between README.md and docs/ (a moved page or a renamed
section breaks a link silently otherwise)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_is_short_and_gives_cis_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m pytest"))
    assert command in readme, f"README no longer gives CI's test command {command!r}"


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such section)")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"docs/{page.name} is not linked from the README"
