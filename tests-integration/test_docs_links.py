"""Every relative link in the docs, the root README and the package READMEs points at something that exists.

Checks Markdown links and images (``[text](target)``, ``![alt](target)``) and reference definitions
(``[id]: target``). External links (``http:``, ``https:``, ``mailto:``) are not fetched. A ``#anchor``
into a Markdown file must match one of its headings (GitHub's slug rules).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    files = sorted((ROOT / "docs").rglob("*.md"))
    files += [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_~\[\]()]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    found: set[str] = set()
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        base = slug(h)
        n = 0
        while (candidate := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(candidate)
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


def links(md: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", md.read_text(encoding="utf-8")))
    return INLINE.findall(text) + REFDEF.findall(text)


def broken_links(md: Path) -> list[str]:
    bad = []
    for target in links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto: — not checked here
        path_part, _, anchor = target.partition("#")
        base = md.parent
        dest = md if not path_part else (base / path_part).resolve()
        if not dest.exists():
            bad.append(
                f"{target} (no such file: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
        elif dest.is_relative_to(ROOT) is False:
            bad.append(f"{target} (points outside the repository)")
    return bad


def test_docs_exist():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    for required in ("docs/architecture.md", "docs/options.md", "docs/faq.md", "README.md"):
        assert required in names


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_broken_relative_links(md: Path):
    assert broken_links(md) == [], f"{md.relative_to(ROOT)} has broken links"


def test_checker_catches_a_broken_link(tmp_path: Path):
    """The checker itself: a missing file and a missing anchor are reported, a good link is not."""
    (tmp_path / "b.md").write_text("# Real Heading\n", encoding="utf-8")
    md = tmp_path / "a.md"
    md.write_text(
        "[ok](b.md) [ok2](b.md#real-heading) [gone](missing.md) [bad](b.md#nope) "
        "`[in code](nowhere.md)` [web](https://example.org/x)\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = broken_links(md)
    finally:
        ROOT = saved
    assert len(bad) == 2 and "missing.md" in bad[0] and "#nope" in bad[1]
