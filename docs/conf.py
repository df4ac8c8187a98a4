"""Sphinx configuration of ddpckpt's documentation site (built with warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

from ddpckpt import __version__  # noqa: E402

project = "ddpckpt"
author = "the ddpckpt developers"
copyright = "2026, the ddpckpt developers"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
    "cli_reference",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}  # the errors page shows its bases
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False

html_theme = "furo"
html_title = f"ddpckpt {version}"
html_static_path = ["_static"]
html_css_files = ["ddpckpt.css"]  # long lines in code blocks: wrap output, scroll code
copybutton_prompt_text = r"\$ "
copybutton_prompt_is_regexp = True
