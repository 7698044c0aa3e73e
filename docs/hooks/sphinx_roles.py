"""MkDocs hook: Sphinx cross-reference roles left in docstrings render as plain code.

cudist's docstrings are Google style but name other objects with Sphinx roles
(``:class:`Optimizer```); mkdocstrings renders them as ``:class:<code>Optimizer</code>``. This drops
the role, leaving the code span (``~`` shortening included).
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):<code>~?")


def on_page_content(html, **kwargs):
    return _ROLE.sub("<code>", html)
