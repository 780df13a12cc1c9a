"""A non-editable install finds the bundled presets (they ship inside the wheel)."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_presets_and_lists_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("plan3d-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "planner/model_specs/llama3-70b.yaml" in names
    assert "planner/hardware_profiles/h100-sxm-80gb.yaml" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    # Run from an empty folder with only the installed copy on the path: no source tree to fall back on.
    res = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['plan3d', 'models']; "
                          "import planner.cli as c; assert 'site' in c.__file__, c.__file__; c.main()"],
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "COLUMNS": "200", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "llama3-405b" in res.stdout and "megatron-gpt-1t" in res.stdout
