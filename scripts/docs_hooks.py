"""MkDocs hooks (mkdocs.yml `hooks:`): keep the site from drifting away from the files it shows.

- `<!-- include: PATH -->` in a page is replaced by that file (PATH relative to the repository root,
  a glob allowed: each match in name order), its headings moved one level down so that an included
  file's title sits under the page's; `<!-- include: PATH#Heading -->` takes only the body of that
  `## Heading` section (README.md's Results, for one). A glob skips the files that the page included
  before it, so a page can name some files first and take the rest with a glob. Links into `docs/`
  (README's plot) are made relative to the site, which is that folder.
- docs/usage.md must name every keyword parameter of `trainstream.wrap` (read from
  python/trainstream/_wrap.py's source) in a table row starting with the backquoted name.
A missing file or section, or an undocumented parameter, fails the build with a message naming it.
"""

from __future__ import annotations

import ast
import glob
import os
import re

from mkdocs.exceptions import PluginError

_INCLUDE = re.compile(r"^<!-- include: (?P<path>[^#\s]+)(?:#(?P<section>[^>]+?))? -->$", re.MULTILINE)
_FENCE = re.compile(r"^\s*(```|~~~)")
_WRAP_SOURCE = "python/trainstream/_wrap.py"


def _root(config) -> str:
    return os.path.dirname(os.path.abspath(config["config_file_path"]))


def _shift_headings(text: str) -> str:
    """One more '#' on every ATX heading outside fenced code blocks."""
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and re.match(r"^#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + "\n"


def _section(text: str, heading: str, path: str) -> str:
    """The lines under `## heading` up to the next heading of level 2 or above."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f"## {heading}")
    except StopIteration:
        raise PluginError(f"docs include: {path} has no section '## {heading}'") from None
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^#{1,2} ", lines[i])), len(lines))
    return "\n".join(lines[start + 1:end]).strip("\n") + "\n"


def _include(match: re.Match, root: str, page: str, done: set[str]) -> str:
    pattern, section = match["path"], match["section"]
    paths = sorted(glob.glob(os.path.join(root, pattern)))
    if not paths:
        raise PluginError(f"docs include in {page}: no file matches {pattern}")
    if glob.has_magic(pattern):
        paths = [p for p in paths if p not in done]
    done.update(paths)
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        text = text.replace("](docs/", "](")
        parts.append(_section(text, section, pattern) if section else _shift_headings(text))
    return "\n".join(parts)


def wrap_parameters(root: str) -> list[str]:
    """The keyword-only parameters of trainstream.wrap, from its source (no import of the package)."""
    with open(os.path.join(root, _WRAP_SOURCE), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "wrap":
            return [a.arg for a in node.args.kwonlyargs]
    raise PluginError(f"docs check: {_WRAP_SOURCE} defines no function wrap")


def expand_includes(markdown: str, root: str, page: str) -> str:
    """`markdown` with its include comments replaced (see the module docstring)."""
    done: set[str] = set()
    return _INCLUDE.sub(lambda m: _include(m, root, page, done), markdown)


def check_wrap_options(markdown: str, root: str) -> None:
    documented = set(re.findall(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`", markdown, re.MULTILINE))
    missing = [p for p in wrap_parameters(root) if p not in documented]
    if missing:
        raise PluginError(f"docs/usage.md: wrap() parameters without a row in an options table: {', '.join(missing)} "
                          f"(add a row starting with | `name` |)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = _root(config)
    markdown = expand_includes(markdown, root, page.file.src_uri)
    if page.file.src_uri == "usage.md":
        check_wrap_options(markdown, root)
    return markdown
