"""scripts/docs_hooks.py, the MkDocs hooks that keep the site true to the files it shows: includes of
whole files and README sections, and the check that docs/usage.md names every wrap() parameter."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("mkdocs")
from mkdocs.exceptions import PluginError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "scripts", "docs_hooks.py"))
docs_hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_hooks)


def test_usage_page_documents_every_wrap_parameter():
    params = docs_hooks.wrap_parameters(ROOT)
    assert {"client", "job", "max_grad_norm", "moment_dtype", "peers"} <= set(params)
    with open(os.path.join(ROOT, "docs", "usage.md")) as f:
        docs_hooks.check_wrap_options(f.read(), ROOT)  # raises if a row is missing


def test_a_wrap_parameter_without_a_row_fails_the_build():
    rows = "\n".join(f"| `{p}` | | |" for p in docs_hooks.wrap_parameters(ROOT) if p != "seed")
    with pytest.raises(PluginError, match=r"without a row .*: seed \("):
        docs_hooks.check_wrap_options("| option | default | what |\n|---|---|---|\n" + rows, ROOT)


def test_includes_take_a_section_or_whole_files_with_headings_one_level_down(tmp_path):
    (tmp_path / "README.md").write_text("# T\n\n## Results\n\n| a |\n|---|\n\n### kept\n\n"
                                        "![plot](docs/images/p.png)\n\n## Layout\n\nnot this\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "a.md").write_text("# A\n\n## part\n\n```sh\n# a shell comment, not a heading\n```\n")
    (tmp_path / "r" / "b.md").write_text("# B\n")
    page = ("<!-- include: README.md#Results -->\n\n<!-- include: r/b.md -->\n\n<!-- include: r/*.md -->\n")
    out = docs_hooks.expand_includes(page, str(tmp_path), "results.md")
    assert "| a |" in out and "### kept" in out and "not this" not in out and "## Layout" not in out
    assert "![plot](images/p.png)" in out  # the site is docs/
    assert "## A\n" in out and "### part\n" in out and "# a shell comment" in out
    assert out.count("## B\n") == 1  # the glob skips the file included before it
    assert out.index("## B") < out.index("## A")


@pytest.mark.parametrize("directive, message", [("<!-- include: nothing/*.md -->", "no file matches nothing/"),
                                                ("<!-- include: README.md#Nope -->", "has no section '## Nope'")])
def test_a_missing_include_fails_the_build(tmp_path, directive, message):
    (tmp_path / "README.md").write_text("## Results\n")
    with pytest.raises(PluginError, match=message):
        docs_hooks.expand_includes(directive + "\n", str(tmp_path), "results.md")
