"""The docs hold together: every relative link and ``#anchor`` in the project's Markdown resolves,
every page under ``docs/`` can be reached from the front page, and the front page stays one.

Anchors are matched against GitHub's slugs of the target's headings (lowercased, punctuation
dropped, spaces to hyphens, ``-1``, ``-2`` for repeats), outside fenced code blocks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from bench import plot
from bench.tools.machine import read_result
from bench.tools.report import splice

ROOT = Path(__file__).resolve().parents[1]
FRONT_PAGE = ROOT / "README.md"
FRONT_PAGE_MAX_LINES = 200
SKIPPED_DIRS = {"node_modules", "__pycache__"}
# bench.plot's copy of bench/README.md's results block, links and all (they are relative to bench/).
SKIPPED_FILES = {ROOT / "bench" / "results" / "summary.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_TARGET = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    """Every Markdown file of the project: hidden folders (.venv, .git) and notes left out."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [Path(folder) / name for name in files if name.endswith(".md")]
    return sorted(set(found) - SKIPPED_FILES)


def prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links and code marks dropped, their text kept."""
    text = LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            repeat = seen.get(base, 0)
            seen[base] = repeat + 1
            found.add(f"{base}-{repeat}" if repeat else base)
    return found


def link_targets(page: Path) -> Iterator[str]:
    for line in prose_lines(page.read_text()):
        line = CODE_SPAN.sub("", line)
        yield from (m.group(2) for m in LINK.finditer(line))
        yield from HTML_TARGET.findall(line)
        reference = REFERENCE.match(line)
        if reference:
            yield reference.group(1)


def relative(target: Path) -> str:
    return target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else str(target)


def broken_link(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, does not resolve; None when it does."""
    if not target or SCHEME.match(target):
        return None  # a web address, mailto: ...: not this repository's to check
    path, _, anchor = target.partition("#")
    path = unquote(path)
    if not path:
        file = page
    elif path.startswith("/"):
        file = (ROOT / path.lstrip("/")).resolve()
    else:
        file = (page.parent / path).resolve()
    if not file.exists():
        return f"{relative(file)} does not exist"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"no heading in {relative(file)} has the anchor #{anchor}"
    return None


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = [
        f"{relative(page)}: ({target}) {why}"
        for page in markdown_files()
        for target in link_targets(page)
        if (why := broken_link(page, target))
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_front_page() -> None:
    reached: set[Path] = set()
    queue = [FRONT_PAGE]
    while queue:
        page = queue.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        for target in link_targets(page):
            path = unquote(target.partition("#")[0])
            if path and not SCHEME.match(path):
                queue.append((page.parent / path).resolve())
    pages = {page for page in markdown_files() if page.is_relative_to(ROOT / "docs")}
    assert not sorted(relative(p) for p in pages - reached), "pages no link from README.md leads to"


def test_the_front_page_stays_short() -> None:
    lines = len(FRONT_PAGE.read_text().splitlines())
    assert lines <= FRONT_PAGE_MAX_LINES, f"README.md has {lines} lines: move detail to a page under docs/"


def test_the_headline_block_is_what_bench_plot_writes() -> None:
    """bench.plot rewrites the block between the front page's bench:headline markers; the committed
    block is what it writes from the committed results."""
    ceiling, token_bucket, naive = (read_result(name) for name in ("ceiling", "serve_token_bucket", "serve_naive"))
    assert ceiling is not None and token_bucket is not None, "bench/results/ lacks the make bench results"
    readme = FRONT_PAGE.read_text()
    begin, end = plot.HEADLINE_MARKERS
    assert readme.count(begin) == 1 and readme.count(end) == 1 and readme.index(begin) < readme.index(end)
    many_texts = read_result("serve_token_bucket_16texts")
    judged = {section.name: read_result(section.name) for section in plot.SECTIONS}
    block = plot.headline_block(ceiling, token_bucket, naive, many_texts, judged)
    assert splice(readme, block, plot.HEADLINE_MARKERS) == readme, "run python -m bench.plot"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Health, metrics, lifecycle", "health-metrics-lifecycle"),
        ("Compile, cache and warmup", "compile-cache-and-warmup"),
        ("CPU: a request, no limit", "cpu-a-request-no-limit"),
        ("`KEMBED_FRONTENDS` and the [CPUs](x.md)", "kembed_frontends-and-the-cpus"),
        ("REST edge: the HTTP stack", "rest-edge-the-http-stack"),
        ("Under faults (measured on the 2-core machine)", "under-faults-measured-on-the-2-core-machine"),
    ],
)
def test_slugs_follow_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Part two\n\n```\n# not a heading\n```\n")
    assert broken_link(page, "#part-two") is None
    assert broken_link(page, "#title") is None
    assert broken_link(page, "#not-a-heading") is not None
    assert broken_link(page, "other.md") is not None
    assert broken_link(page, "https://example.com/x.md#y") is None
    assert list(link_targets(tmp_path / "page.md")) == []
    page.write_text("See [a](other.md#x), `[b](code.md)`, ![c](img.png).\n")
    assert list(link_targets(page)) == ["other.md#x", "img.png"]
