"""The planner's arithmetic never imports torch (torch is only for `plan3d validate`)."""

import subprocess
import sys


def test_cli_import_does_not_import_torch():
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import planner.cli"],
                         capture_output=True, text=True, check=True)
    assert "torch" not in res.stderr


def test_estimate_does_not_import_torch():
    code = ("import sys; from planner.cli import app; from typer.testing import CliRunner;"
            "r = CliRunner().invoke(app, ['estimate', '--model', 'llama3-8b', '--hardware', 'a100-80gb', '--gpus', '8',"
            " '--global-batch', '16', '--seq-len', '2048', '--tp', '2', '--pp', '2', '--json']);"
            "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
