"""The docs stay short, linked and current: every page within its size, every relative link to
a file of the repository (and every anchor to a heading), and the configuration reference
generated from ``Config``'s declarations."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: bytes a page may have: the front door, the contract, the figures, and every other page
LIMITS = {"README.md": 10_000, "design.md": 40_000, "benchmarks.md": 25_000}
PAGE_LIMIT = 20_000

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_doc",
                                                  REPO / "tools" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [a or b for a, b in LINK.findall(text)]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (and explicit ``<a id=...>`` ones)."""
    text = FENCE.sub("", page.read_text())
    anchors, seen = set(re.findall(r'<a id="([^"]+)"', text)), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_configuration_reference_is_generated_from_config():
    gen = _generator()
    current = gen.PAGE.read_text()
    assert current == gen.render(current), (
        f"docs/configuration.md is not current with bpsctl/config.py: run `{gen.COMMAND}`")


def test_every_knob_is_listed_once():
    from bpsctl.config import Config
    page = _generator().PAGE.read_text()
    for _, env, _, _ in Config.describe():
        assert page.count(f"| `{env}`") == 1, f"{env} is not listed once in docs/configuration.md"


def test_every_page_is_within_its_size():
    assert len(PAGES) > 10
    for page in PAGES:
        limit = LIMITS.get(page.name, PAGE_LIMIT)
        size = len(page.read_bytes())
        assert size <= limit, f"{page.relative_to(REPO)} has {size} bytes, over {limit}: split it"


def test_every_relative_link_names_a_file_of_the_repository_and_a_heading_there():
    for page in PAGES:
        where = page.relative_to(REPO)
        for link in _links(page):
            if re.match(r"[a-z]+:", link):              # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            assert target.is_relative_to(REPO) and target.exists(), (
                f"{where} links to {link}, which is not a file of the repository")
            if anchor and target.suffix == ".md":
                assert anchor in _anchors(target), (
                    f"{where} links to {link}: {target.name} has no heading #{anchor}")


def test_no_page_names_a_folder_users_do_not_have():
    for page in PAGES:
        text = page.read_text()
        assert "shared/" not in text, page.name
        assert not re.search(r"\bsessions?\b", text, re.IGNORECASE), page.name
