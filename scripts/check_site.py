"""Checks a built documentation site (scripts/docs.sh runs it after `mkdocs build`): every page in
mkdocs.yml's nav was built, and every image, stylesheet, script and page that a built page refers to
by a relative address exists in the site. Prints what is missing and exits 1; silent when all is there.

    python3 scripts/check_site.py [SITE_DIR]    # default build/site
"""

from __future__ import annotations

import html.parser
import os
import sys
import urllib.parse

import yaml


class _References(html.parser.HTMLParser):
    """Collects the relative addresses in src= and href= attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                parts = urllib.parse.urlsplit(value)
                if not parts.scheme and not parts.netloc and parts.path:
                    self.addresses.append(urllib.parse.unquote(parts.path))


def nav_pages(nav: list) -> list[str]:
    """The Markdown files named in a mkdocs.yml nav (nested sections included)."""
    pages = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            if isinstance(value, list):
                pages += nav_pages(value)
            elif isinstance(value, str) and value.endswith(".md"):
                pages.append(value)
    return pages


def built_path(site: str, page: str) -> str:
    """Where mkdocs (use_directory_urls) writes a page: index.md -> index.html, a.md -> a/index.html."""
    stem = page[:-len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return os.path.join(site, stem + ".html")
    return os.path.join(site, stem, "index.html")


def missing_references(site: str, page_html: str) -> list[str]:
    parser = _References()
    with open(page_html, encoding="utf-8") as f:
        parser.feed(f.read())
    base = os.path.dirname(page_html)
    missing = []
    for address in sorted(set(parser.addresses)):
        target = os.path.normpath(os.path.join(site if address.startswith("/") else base, address.lstrip("/")))
        if os.path.isdir(target):
            target = os.path.join(target, "index.html")
        if not os.path.exists(target):
            missing.append(f"{os.path.relpath(page_html, site)}: {address} does not exist")
    return missing


def main() -> int:
    site = sys.argv[1] if len(sys.argv) > 1 else "build/site"
    with open("mkdocs.yml", encoding="utf-8") as f:
        config = yaml.safe_load(f)
    problems = [f"nav page {page} was not built ({built_path(site, page)} missing)"
                for page in nav_pages(config["nav"]) if not os.path.exists(built_path(site, page))]
    for root, _, names in os.walk(site):
        for name in sorted(names):
            if name.endswith(".html"):
                problems += missing_references(site, os.path.join(root, name))
    for problem in problems:
        print(f"check_site: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
