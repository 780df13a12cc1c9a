"""Safe names for files and scripts made from user-supplied names (a model's ``name``, a profile's).

A model name comes from a YAML file or a Hugging Face ``config.json`` (``_name_or_path`` such as
``Qwen/Qwen2.5-7B``), so it may hold ``/``, ``..``, spaces, quotes, ``$(...)`` or newlines. File
names use :func:`slug` (letters, digits, ``.``, ``_``, ``-`` only, never starting with ``.`` or
``-``); shell scripts use :func:`shlex.quote` on anything that is not a slug.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_SLUG_CHARS = 80


def slug(name: str, fallback: str = "model") -> str:
    """``"Qwen/Qwen2.5-7B"`` -> ``"Qwen-Qwen2.5-7B"``; ``"../../x"`` -> ``"x"``; ``"$(rm -rf /)"`` -> ``"rm--rf"``.

    Every run of characters outside ``[A-Za-z0-9._-]`` becomes one ``-``; leading and trailing
    ``.``/``-`` are dropped (no hidden files, no ``..``, nothing read as an option); the result is at
    most ``MAX_SLUG_CHARS`` characters, and ``fallback`` where nothing safe is left.
    """
    text = _UNSAFE.sub("-", name)
    text = re.sub(r"\.{2,}", ".", text).strip(".-")[:MAX_SLUG_CHARS].strip(".-")
    return text or fallback


def is_slug(name: str) -> bool:
    """True when ``name`` is already safe as a file name and a shell word."""
    return slug(name) == name
