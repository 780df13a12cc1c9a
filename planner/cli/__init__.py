"""The `plan3d` command line: thin typer commands that parse, load specs, call the library, render.

One module per command group, the shared options and error handling in :mod:`planner.cli.common`:

* :mod:`planner.cli.info`: ``models``, ``hardware``, ``show``;
* :mod:`planner.cli.plan`: ``estimate``, ``search``;
* :mod:`planner.cli.files`: ``emit``, ``check``, ``report``;
* :mod:`planner.cli.jobs`: ``validate``, ``calibrate`` (the only commands that import torch).

Importing a command module registers its commands on ``app``; nothing imports this package's
``__init__`` back, so the CLI has no import cycle.
"""

from __future__ import annotations

import sys

from planner.cli import files, info, jobs, plan  # noqa: F401  (register their commands)
from planner.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
