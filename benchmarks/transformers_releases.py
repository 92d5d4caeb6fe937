"""transformers releases read from their wheels with `ast`, and profiles/transformers.toml checked against them.

    python benchmarks/transformers_releases.py [--wheels DIR]   # download, read, write results/..., compare
    python benchmarks/transformers_releases.py --check          # compare the table with the committed facts

For each release in RELEASES (the first and last of every range the table draws, and the releases around each change)
the wheel is fetched with `pip download --no-deps transformers==X` into DIR and read straight out of the zip, never
imported: for each model type vram-plan counts, the keyword arguments its `...ForCausalLM.forward` honours to project
only the last positions to logits (a parameter of that name, or one a `@deprecate_kwarg(old, new_name=...)` renames to
it), whether SDPA's caller makes the query contiguous first, whether it has SDPA attention (`_supports_sdpa = True`
in the module: a run that names no kernel gets SDPA, else eager) and how it masks attention ("per_layer": masking_utils' `create_causal_mask` or
`create_sliding_window_causal_mask`, a boolean mask that SDPA turns into a float copy in every layer; "shared": the
model's own `_update_causal_mask`, one float mask for all layers). One line per disagreement with the table (release,
model type, column, table, wheel); exit code 1 when there is any.
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
from vram_planner.model.architecture import FAMILIES, MODEL_TYPE_ALIASES
from vram_planner.model.transformers_releases import transformers_release
from vram_planner.tracing.hub_kernels import decorated_in

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "transformers_releases.json"
DEFAULT_WHEELS = Path.home() / ".cache" / "vram-plan" / "transformers-wheels"
RELEASES = ("4.44.0", "4.45.0", "4.46.0", "4.48.2", "4.49.0", "4.50.0", "4.51.0", "4.52.0", "4.53.0", "4.54.0",
            "4.55.0", "4.56.0", "4.57.6", "5.0.0", "5.20.0", "5.21.0", "5.22.0", "5.23.0", "5.24.0", "5.25.0")
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


def supports_sdpa(source: str) -> bool:
    """Whether a class of the module sets `_supports_sdpa = True` (PreTrainedModel's own default is False)."""
    assigned = [node.value.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "_supports_sdpa" for t in node.targets)
                and isinstance(node.value, ast.Constant)]
    return bool(assigned) and all(assigned)


def attention_mask(source: str) -> str:
    """"per_layer" where the model builds its mask with masking_utils (transformers 4.53 on), else "shared"."""
    built = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.Name, ast.Attribute))}
    return "per_layer" if built & {"create_causal_mask", "create_sliding_window_causal_mask"} else "shared"


def contiguous_inputs(source: str) -> bool:
    """Whether SDPA's caller makes the query contiguous first (`query.contiguous()`, `query_states.contiguous()`)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "contiguous"
               and getattr(n.func.value, "id", None) in ("query", "query_states") for n in ast.walk(ast.parse(source)))


def rotary_buffers(source: str) -> int:
    """Float buffers each rotary embedding registers: inv_freq, and original_inv_freq where it is a buffer of its own
    (`register_buffer("original_inv_freq", ...)` or `nn.Buffer(...)`, 5.0 on) rather than an alias of inv_freq."""
    tree = ast.parse(source)
    registered = any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "register_buffer" and n.args
                     and getattr(n.args[0], "value", None) == "original_inv_freq" for n in ast.walk(tree))
    assigned = any(isinstance(n, ast.Assign) and any(getattr(t, "attr", None) == "original_inv_freq"
                                                     for t in n.targets)
                   and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", None) == "Buffer"
                   for n in ast.walk(tree))
    return 2 if registered or assigned else 1


def kernelizes_by_default(source: str) -> bool:
    """Whether modeling_utils.py's from_pretrained kernelizes a model that names no use_kernels: the keyword's
    default (`kwargs.pop("use_kernels", X)`) is True, or None made True (`elif use_kernels is None: use_kernels =
    True`, 5.25 on)."""
    tree = ast.parse(source)
    defaults = [n.args[1].value for n in ast.walk(tree)
                if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "pop" and len(n.args) == 2
                and getattr(n.args[0], "value", None) == "use_kernels" and isinstance(n.args[1], ast.Constant)]
    made_true = any(isinstance(n, ast.If) and isinstance(n.test, ast.Compare)
                    and getattr(n.test.left, "id", None) == "use_kernels" and isinstance(n.test.ops[0], ast.Is)
                    and any(isinstance(b, ast.Assign) and getattr(b.targets[0], "id", None) == "use_kernels"
                            and getattr(b.value, "value", None) is True for b in n.body)
                    for n in ast.walk(tree))
    return bool(defaults) and (defaults[0] is True or (defaults[0] is None and made_true))


def hub_decorated(source: str, layer: str) -> bool:
    """Whether the modeling code decorates a class or function with use_kernel_forward_from_hub(layer), as the trace
    reads it."""
    return layer in decorated_in(source).values()


SDPA_INTEGRATION = "transformers/integrations/sdpa_attention.py"  # shared by the models from 4.48
MODELING_UTILS = "transformers/modeling_utils.py"
TRAINING_ARGS = "transformers/training_args.py"


def release_facts(path: Path) -> dict[str, dict[str, Any]]:
    with zipfile.ZipFile(path) as archive:
        members = set(archive.namelist())
        shared_sdpa = archive.read(SDPA_INTEGRATION).decode() if SDPA_INTEGRATION in members else None
        kernelized = kernelizes_by_default(archive.read(MODELING_UTILS).decode())
        facts = {}
        for model_type in MODEL_TYPES:
            member = f"transformers/models/{model_type}/modeling_{model_type}.py"
            if member in members:
                source = archive.read(member).decode()
                names = honoured_names(source)
                shared = shared_sdpa is not None and "ALL_ATTENTION_FUNCTIONS" in source
                sdpa = shared_sdpa if shared else source
                if names is not None:
                    facts[model_type] = {"logits_to_keep_names": names, "supports_sdpa": supports_sdpa(source),
                                         "attention_mask": attention_mask(source),
                                         "sdpa_contiguous_inputs": contiguous_inputs(sdpa),
                                         # use_gqa_in_sdpa: k and v unrepeated where no mask is given (4.54 on)
                                         "sdpa_gqa_without_mask": shared and "use_gqa_in_sdpa(" in sdpa,
                                         # pack_gqa: a decoding step's single query on the key/value heads (5.23 on)
                                         "sdpa_decoding_gqa": shared and "pack_gqa(" in sdpa,
                                         # what the Hub's kernels replace when from_pretrained kernelizes by default
                                         "kernelized_rms_norm": kernelized and hub_decorated(source, "RMSNorm"),
                                         "kernelized_rotary": kernelized and hub_decorated(source, "rotary_pos_emb")}
                    if model_type == "llama":
                        facts[model_type]["rotary_buffers"] = rotary_buffers(source)
        return facts


def training_arguments_facts(path: Path) -> dict[str, str]:
    """What TrainingArguments (GRPOConfig's base) calls gradient checkpointing: "activation_checkpointing" where it
    has a field of that name (5.23 on; the old name an alias), else "gradient_checkpointing"."""
    with zipfile.ZipFile(path) as archive:
        tree = ast.parse(archive.read(TRAINING_ARGS).decode())
    fields = {node.target.id for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == "TrainingArguments"
              for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return {"checkpointing_argument": "activation_checkpointing" if "activation_checkpointing" in fields
            else "gradient_checkpointing"}


def extract(folder: Path) -> dict[str, Any]:
    return {"made": date.today().isoformat(),
            "source": "pip download --no-deps transformers==X; models/<type>/modeling_<type>.py: ...ForCausalLM.forward, "
                      "_supports_sdpa, the mask it builds, its use_kernel_forward_from_hub decorations; "
                      "modeling_utils.py: from_pretrained's use_kernels default; training_args.py: TrainingArguments' "
                      "fields",
            "releases": {v: release_facts(wheel(v, folder)) for v in RELEASES},
            "training_arguments": {v: training_arguments_facts(wheel(v, folder)) for v in RELEASES}}


def disagreements(facts: dict[str, Any]) -> list[str]:
    """One line per release, model type and column where the wheel differs from the table's row."""
    lines = []
    for version, types in facts["releases"].items():
        row = transformers_release(version, int(version.split(".")[0]))
        table = {"logits_to_keep_names": sorted(row.logits_to_keep_names, key=NAMES.index),
                 "attention_mask": row.attention_mask, "sdpa_contiguous_inputs": row.sdpa_contiguous_inputs,
                 "sdpa_gqa_without_mask": row.sdpa_gqa_without_mask, "sdpa_decoding_gqa": row.sdpa_decoding_gqa,
                 "rotary_buffers": row.rotary_buffers}
        for model_type, read in types.items():
            family = FAMILIES[MODEL_TYPE_ALIASES.get(model_type, model_type)]
            said = {**table, "supports_sdpa": row.supports_sdpa(model_type),
                    "kernelized_rms_norm": row.hub_kernels and family.hub_rms_norm,
                    "kernelized_rotary": row.hub_kernels and family.hub_rotary}
            lines += [f"transformers {version} {model_type}: {column} table {said[column]}, wheel {value}"
                      for column, value in read.items() if said[column] != value]
    for version, read in facts.get("training_arguments", {}).items():
        row = transformers_release(version, int(version.split(".")[0]))
        lines += [f"transformers {version} TrainingArguments: {column} table {getattr(row, column)}, wheel {value}"
                  for column, value in read.items() if getattr(row, column) != value]
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
