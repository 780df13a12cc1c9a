"""The bad-input error and the input bounds, in a module with no dependencies so that the CLI's
start-up (``plan3d --help``) need not import pydantic or YAML."""

from __future__ import annotations

#: Upper bound on any GPU count: the largest published training clusters hold ~10^5 GPUs.
MAX_GPUS = 1_000_000
#: Upper bound on a sequence length or a global batch (10^8 tokens or sequences).
MAX_COUNT = 100_000_000


class SpecError(Exception):
    """Bad user input. ``lines`` are printed one per line, without a traceback."""

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))
