"""MkDocs hook: the build fails unless every public name of the documented modules has a reference entry.

After the site is built, the names in each module's ``__all__`` are looked up in the inventory that
mkdocstrings writes (``objects.inv``, the anchors of every rendered object). A public name added to
the code without a rendered entry makes ``mkdocs build`` fail, naming it.
"""

from __future__ import annotations

import importlib
import zlib
from pathlib import Path

from mkdocs.exceptions import PluginError

#: The modules whose every public name must be in the reference.
MODULES = ("cudist", "cudist.data", "cudist.config", "cudist.experimental", "cudist.errors", "cudist.optimizers",
           "cudist.mixed_precision", "cudist.optimizers.schedules", "cudist.cluster_resolver", "cudist.losses", "cudist.metrics", "cudist.nn",
           "cudist.train", "cudist.train.experimental", "cudist.launch")


def inventory_names(path: Path) -> set[str]:
    """The object names of a Sphinx-style ``objects.inv`` (version 2: four header lines, zlib body)."""
    data = path.read_bytes()
    lines = data.split(b"\n", 4)
    body = zlib.decompress(lines[4]).decode("utf-8")
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def missing_names(names: set[str]) -> list[str]:
    """``module.name`` for each public name of :data:`MODULES` that ``names`` lacks."""
    out = []
    for mod in MODULES:
        m = importlib.import_module(mod)
        for name in getattr(m, "__all__", ()):
            if name.startswith("__"):  # __version__ has its own line on the cudist page
                continue
            if f"{mod}.{name}" not in names:
                out.append(f"{mod}.{name}")
    return out


def on_post_build(config, **kwargs):
    inv = Path(config["site_dir"]) / "objects.inv"
    if not inv.is_file():
        raise PluginError(f"{inv} was not written (is mkdocstrings enabled?)")
    missing = missing_names(inventory_names(inv))
    if missing:
        raise PluginError("public names without a reference entry in docs/reference/api/: " + ", ".join(missing))
