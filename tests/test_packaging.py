"""What `pip install .` ships: every subpackage of vram_planner and every data folder of the profiles."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_for_setuptools():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "vram_planner").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


def test_every_listed_package_is_a_folder_of_the_tree():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: ROOT / config["package-dir"].get(package, package.replace(".", "/"))
               for package in config["packages"]}
    stale = sorted(package for package, folder in folders.items() if not (folder / "__init__.py").is_file())
    assert not stale, f"remove {stale} from [tool.setuptools] packages (no such folder)"


def test_every_profile_data_file_is_shipped():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = config["vram_planner.profile_data"]
    data = [p for p in (ROOT / "profiles").rglob("*") if p.is_file() and p.suffix in (".toml", ".json", ".jsonl")]
    unshipped = [p for p in data if not any(p.relative_to(ROOT / "profiles").match(pattern) for pattern in patterns)]
    assert not unshipped, unshipped
