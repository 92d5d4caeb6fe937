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


def _tested_set() -> dict[str, str]:
    """constraints.txt: the tested set of library versions, name -> version."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_the_readme_and_ci_install_the_tested_set():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv .venv"))
    assert '.venv/bin/pip install -e ".[test]" -c constraints.txt' in command
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[test]" -c constraints.txt' in ci
    # CI builds the release pairs' environments and runs the suite as the README says
    tests = command[command.index(".venv/bin/python benchmarks/trl_matrix.py --build-only"):]
    assert ci.rstrip().endswith(tests) and "-n auto" in tests


def test_the_tested_set_pins_the_training_stack_within_the_packages_own_ranges():
    from packaging.requirements import Requirement

    pins = _tested_set()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["train"]]
    for requirement in requirements:
        assert requirement.name in pins, f"constraints.txt pins no {requirement.name}"
        assert requirement.specifier.contains(pins[requirement.name]), (requirement, pins[requirement.name])


def test_the_tested_releases_are_rows_of_the_release_tables():
    from vram_planner.model.transformers_releases import known_transformers_version
    from vram_planner.model.trl_releases import trl_release

    pins = _tested_set()
    assert trl_release(pins["trl"]).version == pins["trl"]
    assert known_transformers_version(pins["transformers"]) == pins["transformers"]
