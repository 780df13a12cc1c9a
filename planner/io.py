"""File output that never loses what the user had: refuse to replace without ``force``, write atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from planner.presets import SpecError


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_atomic(path: str | Path, text: str, force: bool = False, option: str = "--out", mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename.

    An existing file is replaced only with ``force``; a failed write leaves no partial file.
    """
    target = Path(path)
    if target.is_dir():
        raise SpecError(f"{option}: {target} is a folder; give a file name")
    if target.exists() and not force:
        raise SpecError(f"{option}: {target} exists; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise SpecError(f"{option}: folder {target.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as err:
        raise SpecError(f"{option}: cannot write in {target.parent}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise SpecError(f"{option}: cannot write {target}: {err.strerror or err}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_folder(out_dir: str | Path, option: str) -> Path:
    """Create ``out_dir`` (and its parents) or say in one line why it cannot be."""
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"{option}: {folder} is a file, not a folder; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(f"{option}: cannot create folder {folder}: {err.strerror or err}") from None
    return folder


def refuse_replacing(option: str, clash: list[Path]) -> None:
    """The one-line refusal to replace the files of ``clash`` without ``--force`` (nothing where it is empty)."""
    if clash:
        raise SpecError(f"{option}: {', '.join(map(str, clash))} {'exists' if len(clash) == 1 else 'exist'}; "
                        "pass --force to overwrite")


def holds(path: Path, text: str) -> bool:
    """Whether the file at ``path`` holds exactly ``text`` (False where it cannot be read as UTF-8)."""
    try:
        return path.is_file() and path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        return False


def write_all(out_dir: str | Path, files: dict[str, str], force: bool = False, option: str = "--out-dir",
              unchanged: list[Path] | None = None) -> list[Path]:
    """Write several files; check first that none would be replaced without ``force``, so it is all or nothing.

    Every name must be a plain file name (no folder part, not hidden): nothing is written outside ``out_dir``.
    A file that already holds exactly the text to write is no clash and is left as it is (nothing of the user's
    would be lost: one format after another into one folder writes the plan file that several of them carry,
    ``plan3d emit --format slurm`` then ``--format deepspeed``); it is listed in the return value and, where
    ``unchanged`` is given, appended to it.
    """
    bad = [n for n in files if not n or n != Path(n).name or n.startswith(".") or "\\" in n or "\n" in n]
    if bad:  # file names come from planner.names.slug; this guards the folder whatever a caller passes
        raise SpecError(f"{option}: refusing to write {bad[0]!r}: not a plain file name inside {out_dir}")
    folder = make_folder(out_dir, option)
    same = {name for name, text in files.items() if holds(folder / name, text)}
    if not force:
        refuse_replacing(option, [folder / name for name in files if (folder / name).exists() and name not in same])
    written = []
    for name, text in files.items():
        if name in same:
            if unchanged is not None:
                unchanged.append(folder / name)
        else:
            write_atomic(folder / name, text, force=True, option=option,
                         mode=0o777 & ~_umask() if name.endswith((".sh", ".slurm")) else None)
        written.append(folder / name)
    return written
