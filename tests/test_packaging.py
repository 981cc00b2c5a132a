"""setup.cfg lists every package of the source tree: a package missing there is missing from every install (CI
installs the wheel, so its tests would fail at import, far from the cause)."""

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# setup.cfg's package_dir: the package name of each top-level source folder.
TOP_LEVEL = {"cli": "moe_tune.cli", "engine": "moe_tune.engine", "ops": "moe_tune.ops", "profiles": "moe_tune.profiles"}


def test_setup_cfg_lists_every_package():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    found = {"moe_tune"}
    for folder, package in TOP_LEVEL.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found - listed == set(), "packages missing from setup.cfg [options] packages"
    assert listed - found == set(), "setup.cfg lists packages that do not exist"
