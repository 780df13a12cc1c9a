import os

import pytest

os.environ.setdefault("COLUMNS", "200")


@pytest.fixture
def runner():
    from typer.testing import CliRunner

    return CliRunner()
