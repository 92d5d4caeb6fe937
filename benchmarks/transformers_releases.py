"""transformers releases read from their wheels with `ast`, and profiles/transformers.toml checked against them.

    python benchmarks/transformers_releases.py [--wheels DIR]   # download, read, write results/..., compare
    python benchmarks/transformers_releases.py --check          # compare the table with the committed facts

For each release in RELEASES (the first and last of every range the table draws, and the releases around each change)
the wheel is fetched with `pip download --no-deps transformers==X` into DIR and read straight out of the zip, never
imported: for each model type vram-plan counts, the keyword arguments its `...ForCausalLM.forward` honours to project
only the last positions to logits (a parameter of that name, or one a `@deprecate_kwarg(old, new_name=...)` renames to
it). One line per disagreement with the table (release, model type, table, wheel); exit code 1 when there is any.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from datetime import date
from pathlib import Path
from typing import Any

from vram_planner.files import write_atomically
from vram_planner.model.transformers_releases import transformers_release

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "transformers_releases.json"
DEFAULT_WHEELS = Path.home() / ".cache" / "vram-plan" / "transformers-wheels"
RELEASES = ("4.44.0", "4.45.0", "4.46.0", "4.48.2", "4.49.0", "4.50.0", "4.51.0", "4.52.0", "4.53.0", "4.54.0",
            "4.55.0", "4.56.0", "5.0.0")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3")
NAMES = ("num_logits_to_keep", "logits_to_keep")


def wheel(version: str, folder: Path) -> Path:
    path = folder / f"transformers-{version}-py3-none-any.whl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"transformers=={version}",
                        "-d", str(folder)], check=True)
    return path


def honoured_names(source: str) -> list[str] | None:
    """The names the module's ...ForCausalLM.forward honours, or None where the module has no such class."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("ForCausalLM")
                and not node.name.startswith("Kwargs")):
            continue
        forward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if forward is None:
            continue
        params = {a.arg for a in forward.args.args + forward.args.kwonlyargs}
        names = [n for n in NAMES if n in params]
        for decorator in forward.decorator_list:  # @deprecate_kwarg("num_logits_to_keep", ..., new_name=...)
            if (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "deprecate_kwarg"
                    and decorator.args and getattr(decorator.args[0], "value", None) in NAMES
                    and any(k.arg == "new_name" and getattr(k.value, "value", None) in params
                            for k in decorator.keywords)):
                names.append(decorator.args[0].value)
        return sorted(set(names), key=NAMES.index)
    return None


def release_facts(path: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(path) as archive:
        members = set(archive.namelist())
        facts = {}
        for model_type in MODEL_TYPES:
            member = f"transformers/models/{model_type}/modeling_{model_type}.py"
            if member in members:
                names = honoured_names(archive.read(member).decode())
                if names is not None:
                    facts[model_type] = names
        return facts


def extract(folder: Path) -> dict[str, Any]:
    return {"made": date.today().isoformat(),
            "source": "pip download --no-deps transformers==X; models/<type>/modeling_<type>.py, ...ForCausalLM.forward",
            "releases": {v: release_facts(wheel(v, folder)) for v in RELEASES}}


def disagreements(facts: dict[str, Any]) -> list[str]:
    """One line per release and model type whose honoured names differ from the table's row."""
    lines = []
    for version, types in facts["releases"].items():
        row = transformers_release(version, int(version.split(".")[0]))
        for model_type, names in types.items():
            table = sorted(row.logits_to_keep_names, key=NAMES.index)
            if table != names:
                lines.append(f"transformers {version} {model_type}: logits_to_keep_names table {table}, wheel {names}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS)
    parser.add_argument("--check", action="store_true", help="compare with the committed facts, no network")
    args = parser.parse_args(argv)
    if args.check:
        facts = json.loads(RESULTS.read_text())
    else:
        facts = extract(args.wheels)
        write_atomically(RESULTS, json.dumps(facts, indent=1) + "\n")
    lines = disagreements(facts)
    print("\n".join(lines) or f"the table agrees with {len(facts['releases'])} releases' wheels")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
