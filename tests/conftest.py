import os
import sys
import tarfile
from pathlib import Path

import pytest

os.environ.setdefault("COLUMNS", "200")

#: ../shared beside the repository (PLAN3D_SHARED overrides it, e.g. from a git worktree).
SHARED = Path(os.environ.get("PLAN3D_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
MEGATRON_TARBALL = SHARED / "consumers" / "megatron-lm-core_v0.16.1.tar.gz"


@pytest.fixture
def runner():
    from typer.testing import CliRunner

    return CliRunner()


@pytest.fixture(scope="session")
def megatron_lm_root(tmp_path_factory):
    """Megatron-LM core_v0.16.1 (../shared/consumers) extracted once per session and put on sys.path;
    the test skips, with the reason, where ../shared is absent."""
    if not MEGATRON_TARBALL.is_file():
        pytest.skip(f"{MEGATRON_TARBALL} is absent (../shared is laid only on the project's machines)")
    root = tmp_path_factory.mktemp("megatron-lm")
    with tarfile.open(MEGATRON_TARBALL) as tar:
        tar.extractall(root, filter="data")
    sys.path.insert(0, str(root))
    yield root


def _import_from_megatron(load):
    """``load()``'s result, run with the pinned Megatron-LM on the path and its import-time warnings silenced; the
    test skips, with the reason, where torch or Megatron-Core does not import."""
    pytest.importorskip("torch", reason="Megatron-Core imports torch")
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load()
    except ImportError as err:
        pytest.skip(f"Megatron-Core does not import here: {err}")


@pytest.fixture(scope="session")
def megatron_import(megatron_lm_root):
    """:func:`_import_from_megatron` for fixtures that import their own Megatron-Core modules."""
    return _import_from_megatron


@pytest.fixture(scope="session")
def megatron_schedules(megatron_import):
    """Megatron-Core's ``pipeline_parallel.schedules`` from the pinned source (skips where it does not import)."""
    import importlib

    yield megatron_import(lambda: importlib.import_module("megatron.core.pipeline_parallel.schedules"))
