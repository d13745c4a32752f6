"""Sphinx configuration of the torchdoctor manual (HTML with furo, man pages with `-b man`).

Why Sphinx rather than mkdocs: one source gives both the site and the man pages (Sphinx's man
builder), sphinx-click renders the click commands as they are (options, defaults, help), and
`-W -n` makes every warning and every unresolved reference fail the build. Pages are Markdown
(MyST); the reference pages are generated at build time by _ext/torchdoctor_docs.py from the
code itself (commands, rules, thresholds, metrics, JSON schemas, benchmark figures).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))

import torchdoctor  # noqa: E402
from torchdoctor.cli import COMMANDS  # noqa: E402

project = "torchdoctor"
author = "The torchdoctor authors"
copyright = "The torchdoctor authors, Apache-2.0"  # noqa: A001 - Sphinx's own name
version = release = torchdoctor.__version__
# The man pages carry the version, not the build date: regenerated pages only change when
# their content does.
today = f"torchdoctor {release}"

extensions = ["myst_parser", "sphinx_click", "torchdoctor_docs"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# Pages included into others, not pages of their own.
exclude_patterns = ["_build", "reference/benchmark-table.md", "reference/architecture.md"]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# A link to a file outside the manual (README, ARCHITECTURE.md) is a warning, so a build that
# passes links nothing that is missing.
suppress_warnings: list[str] = []

html_theme = "furo"
html_title = f"torchdoctor {release}"
html_static_path: list[str] = []

# One man page for the program and one per command (torchdoctor-run(1), ...), from the same
# generated reference pages as the site's CLI reference.
man_pages = [("reference/cli/index", "torchdoctor", torchdoctor.__doc__.splitlines()[0], "", 1)]
man_pages += [
    (f"reference/cli/{name}", f"torchdoctor-{name}", summary, "", 1)
    for name, (_module, summary) in COMMANDS.items()
]
man_show_urls = False
