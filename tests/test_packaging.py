"""The wheel: everything under one import package, the shipped YAML inside, the console script declared; setup.cfg
lists every package of the source tree (one missing there is missing from every install, and CI installs the
wheel, so its tests would fail at import, far from the cause)."""

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_holds_one_package_with_the_shipped_profiles(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = tmp_path.glob("moe_tune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"moe_tune"}
    for required in ("moe_tune/profiles/tiny.yaml", "moe_tune/cli/__init__.py", "moe_tune/engine/train/trainer.py",
                     "moe_tune/ops/linear_attention/reference.py", "moe_tune/ops/moe/reference.py",
                     "moe_tune/ops/cross_entropy/reference.py"):
        assert required in names, required
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "moe-tune = moe_tune.cli:main" in entry_points


def test_setup_cfg_lists_every_package():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    # package_dir maps each top-level package to its source folder (moe_tune itself to a shim folder).
    package_dir = dict(line.split(" = ") for line in config["options"]["package_dir"].strip().splitlines())
    found = {"moe_tune"}
    for package, folder in package_dir.items():
        if package == "moe_tune":
            continue
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *relative)))
    assert found - listed == set(), "packages missing from setup.cfg [options] packages"
    assert listed - found == set(), "setup.cfg lists packages that do not exist"
