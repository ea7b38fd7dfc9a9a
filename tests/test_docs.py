"""The README and docs/ pages link to pages and sections that exist."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str):
    with open(path) as f:
        return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", f.read(), re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    links = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith(("http://", "https://"))]
    assert links or page == "docs/api.md"
    for link in links:
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else os.path.join(ROOT, page)
        assert os.path.exists(path), f"{page} links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{page} links to {link}: no such section in {target or page}"


def test_every_page_is_linked_from_the_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for page in PAGES[1:]:
        assert f"]({page})" in readme or f"]({page}#" in readme, f"{page} is not linked from the README"
