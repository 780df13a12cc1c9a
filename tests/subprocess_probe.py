"""Run a probe script (one that imports a framework needing its own process environment, such as DeepSpeed with
``DS_ACCELERATOR=cpu`` and a one-rank rendezvous) in a fresh Python process, and read the JSON line it prints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_json_probe(script: str | Path, timeout_s: float = 600, extra_args: list[str] = ()):
    """Runs ``python script PORT *extra_args`` (a free local port for its rendezvous) from the repository root and
    returns the last line of its stdout that starts with ``{``, parsed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script), str(port), *extra_args]
    try:
        res = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:  # what the probe said before it was killed, for the CI log
        raise AssertionError(f"{script} ran past {timeout_s:.0f} s; its stderr ended:\n{_tail(e.stderr)}") from None
    if res.returncode != 0:
        raise AssertionError(f"{script} exited {res.returncode}; its stderr ended:\n{_tail(res.stderr)}")
    return json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])


def _tail(text: str | bytes | None, chars: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]
