"""The bad-input error and the input bounds, in a module with no dependencies so that the CLI's
start-up (``plan3d --help``) need not import pydantic or YAML."""

from __future__ import annotations

from pathlib import Path

#: Upper bound on any GPU count: the largest published training clusters hold ~10^5 GPUs.
MAX_GPUS = 1_000_000
#: Upper bound on a sequence length or a global batch (10^8 tokens or sequences).
MAX_COUNT = 100_000_000


#: Characters that break or corrupt a terminal line (C0 and C1 controls but the tab, and the line and paragraph
#: separators ``str.splitlines`` also splits at), written as their escapes in an error line.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7f, 0xa0), 0x2028, 0x2029) if c != 0x09}


def one_line(text: str) -> str:
    """``text`` as one line: the line breaks and control characters it holds (a quoted value of a user's file that
    an error names) written as escapes, ``\\n`` for a newline."""
    return text.translate(_ESCAPES)


class SpecError(Exception):
    """Bad user input. ``lines`` are printed one per line, without a traceback; each is kept to one line
    (:func:`one_line`) whatever user text it quotes."""

    def __init__(self, lines: list[str] | str):
        self.lines = [one_line(str(x)) for x in ([lines] if isinstance(lines, str) else lines)]
        super().__init__("\n".join(self.lines))


def missing_file(path: Path | str) -> str:
    """Why ``path`` is no readable file, where ``Path.is_file`` said so: it does not exist, or it exists and is
    not a regular file (a device such as /dev/null, a FIFO, a socket)."""
    if Path(path).exists():
        return f"{path} is not a regular file; give the path of a file"
    return f"file {path} does not exist"
