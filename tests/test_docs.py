"""The README stays a front door (at most 200 lines), and every relative link in README.md and docs/*.md
reaches an existing file and, where it names one, an existing heading anchor; every fallback reason has
its cause and fix; no table cell is a paragraph. No framework is imported."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(path):
    """The lines of a Markdown file outside fenced code blocks."""
    in_fence = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            if not in_fence:
                yield line.rstrip("\n")


def anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen, result = {}, set()
    for line in prose_lines(path):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(path):
    for line in prose_lines(path):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                yield target


def test_readme_is_at_most_200_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(dest):
            broken.append(f"{target}: no such path")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_every_fallback_reason_has_its_cause_and_fix_in_docs():
    """docs/fallbacks.md, the page a user opens when a call did not replay, has a section per reason of
    graph_opt.watch.fallbacks.Reason (the keys of stats().fallback_reasons), each with a cause and a fix."""
    from graph_opt.watch.fallbacks import Reason

    text = open(os.path.join(ROOT, "docs", "fallbacks.md"), encoding="utf-8").read()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    documented = {re.match(r"`([a-z_]+)`", s).group(1) for s in sections}
    assert documented == {r.value for r in Reason}
    for s in sections:
        assert "**Cause:**" in s and "**Fix:**" in s, s.splitlines()[0]


MAX_CELL = 400


def table_cells(path):
    """Every cell of the Markdown tables outside code blocks (a `\\|` is not a border)."""
    for line in prose_lines(path):
        if line.lstrip().startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                yield cell.strip()


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_table_cells_stay_short(page):
    """A table is for scanning: a cell of more than MAX_CELL characters is a paragraph, which belongs
    below the table (a list of notes), with a short summary left in the cell."""
    long_cells = [f"{len(c)} characters: {c[:70]}..." for c in table_cells(page) if len(c) > MAX_CELL]
    assert not long_cells, long_cells


def test_every_fallback_reason_has_the_one_line_fix_explain_gives():
    from graph_opt.watch.fallbacks import FIXES, Reason

    assert set(FIXES) == set(Reason) and all(fix.strip() for fix in FIXES.values())
