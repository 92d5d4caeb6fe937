"""Every TRL release from 0.14.0 to 1.16.0 read from its wheel with `ast`, and profiles/trl.toml checked against it.

    python benchmarks/trl_releases.py [--cache DIR]   # download, extract, write results/trl_releases.json, compare
    python benchmarks/trl_releases.py --check         # compare the table with the committed facts (no network)

Each release's wheel (and the wheel of the transformers release of its time: the newest final transformers release
on PyPI before the TRL wheel's upload that TRL's `Requires-Dist` allows) is downloaded with pip into the cache,
checked against PyPI's sha256 and read straight out of the zip: TRL is never imported or executed. The facts are
GRPOConfig's defaults (TrainingArguments' where GRPOConfig has none), what `__post_init__` sets when a knob is left
None, the `ValueError`s on num_generations and the batch, and markers of how the trainer spends memory. One line per
disagreement with the table (release, column, table, fact); the exit code is 1 when there is any.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime
from email.parser import Parser
from functools import cached_property
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

from vram_planner.errors import VramPlanError
from vram_planner.files import write_atomically
from vram_planner.model.trl_releases import TrlRelease, trl_release
from vram_planner.validation import field_names

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "trl_releases.json"
DEFAULT_CACHE = Path.home() / ".cache" / "vram-plan" / "trl-wheels"
PYPI_JSON = "https://pypi.org/pypi/{project}/json"
OLDEST, NEWEST = Version("0.14.0"), Version("1.16.0")
# A default computed from the torch version (transformers' optim) is reported for this torch: the one the project pins.
CURRENT_TORCH = Version("2.13.0")
# The knobs whose defaults decide memory or validity; GRPOConfig's own, else TrainingArguments'.
FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16", "fp16",
          "beta", "max_prompt_length", "max_completion_length", "num_generations", "num_iterations",
          "steps_per_generation", "generation_batch_size", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
          "vllm_device", "vllm_importance_sampling_correction", "model_init_kwargs", "optim", "learning_rate",
          "logging_steps", "use_liger_loss", "use_liger_kernel", "cast_lm_head_to_fp32", "temperature", "top_p",
          "top_k", "min_p", "repetition_penalty")
# generate()'s own defaults for the sampling knobs a release's GRPOConfig lacks (TRL 0.14-0.15 pass temperature only)
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
TRAINER = ("trl.trainer.grpo_trainer", "GRPOTrainer")
CONFIG = ("trl.trainer.grpo_config", "GRPOConfig")


# --- PyPI and the wheel cache ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wheel:
    """One release's wheel as PyPI lists it."""

    project: str
    version: str
    filename: str
    sha256: str
    uploaded: datetime


def pypi_releases(project: str) -> tuple[list[str], dict[str, Wheel]]:
    """The releases PyPI lists for `project` (those with a file not yanked), and each one's pure-Python wheel."""
    url = PYPI_JSON.format(project=project)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            releases = json.load(response)["releases"]
    except OSError as error:
        raise SystemExit(f"error: cannot read {url} ({error}); --check compares the committed facts offline")
    listed, wheels = [v for v, files in releases.items() if any(not f["yanked"] for f in files)], {}
    for version, files in releases.items():
        for file in files:
            if file["packagetype"] == "bdist_wheel" and file["filename"].endswith("-py3-none-any.whl") \
                    and not file["yanked"]:
                uploaded = datetime.fromisoformat(file["upload_time_iso_8601"].replace("Z", "+00:00"))
                wheels[version] = Wheel(project, version, file["filename"], file["digests"]["sha256"], uploaded)
    return sorted(listed, key=Version), wheels


def downloaded(wheel: Wheel, cache: Path) -> Path:
    """The wheel's path in the cache, downloaded with pip when missing; its sha256 must be PyPI's."""
    path = cache / wheel.filename
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               f"{wheel.project}=={wheel.version}", "--dest", str(cache)], stderr=subprocess.DEVNULL)
        if done.returncode != 0 or not path.is_file():
            raise SystemExit(f"error: pip could not download {wheel.filename} into {cache}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != wheel.sha256:
        path.unlink()
        raise SystemExit(f"error: {path} does not match PyPI's sha256; deleted it, run again to download it anew")
    return path


def transformers_of_the_time(trl: Wheel, spec: str, transformers: dict[str, Wheel]) -> Wheel:
    """The newest final transformers release uploaded before the TRL wheel that its requirement allows."""
    requirement = Requirement(f"transformers{spec}")
    allowed = [w for w in transformers.values() if w.uploaded < trl.uploaded and not Version(w.version).is_prerelease
               and requirement.specifier.contains(w.version)]
    return max(allowed, key=lambda w: Version(w.version))


# --- Reading a wheel ------------------------------------------------------------------------------------------------

class WheelSource:
    """The modules and metadata of a wheel, parsed on demand, never imported."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        """The syntax tree of a module (or package __init__) of the wheel, None when it has none."""
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            name = next((n for n in (f"{base}.py", f"{base}/__init__.py") if n in self.names), None)
            self._trees[dotted] = ast.parse(self.zip.read(name), name) if name else None
        return self._trees[dotted]

    def package(self, dotted: str) -> list[str]:
        """The package a module's relative imports start from: itself for a package's __init__."""
        is_package = f"{dotted.replace('.', '/')}/__init__.py" in self.names
        return dotted.split(".") if is_package else dotted.split(".")[:-1]

    @cached_property
    def requirements(self) -> dict[str, str]:
        """Requires-Dist specifiers that apply without extras on a current Python, by project."""
        name = next(n for n in self.names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(self.zip.read(name).decode())
        found: dict[str, list[str]] = {}
        for line in metadata.get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                found.setdefault(requirement.name.lower(), []).append(str(requirement.specifier))
        return {project: ",".join(sorted(s for s in specs if s)) for project, specs in found.items()}


def top_level(tree: ast.Module, kind: type, name: str) -> ast.AST | None:
    """The class or function `name` defined at the top of a module."""
    return next((n for n in tree.body if isinstance(n, kind) and n.name == name), None)


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    """A method defined in a class's own body."""
    if cls is None:
        return None
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def imported_from(tree: ast.Module, package: list[str], name: str) -> str | None:
    """The module that a module of `package` imports `name` from (relative imports resolved), None when it does
    not."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            anchor = package[:len(package) - node.level + 1] if node.level else []
            return ".".join(anchor + ([node.module] if node.module else []))
    return None


def resolve(src: WheelSource, module: str, name: str, kind: type) -> tuple[str, ast.AST] | None:
    """Where `name`, used in `module`, is defined: follows imports through the wheel (package __init__s too)."""
    for _ in range(4):
        tree = src.module(module)
        if tree is None:
            return None
        found = top_level(tree, kind, name)
        if found is not None:
            return module, found
        source = imported_from(tree, src.package(module), name)
        if source is None:
            return None
        alias = next(a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     for a in n.names if (a.asname or a.name) == name)
        module, name = source, alias
    return None


def calls(node: ast.AST, name: str) -> list[ast.Call]:
    """The calls under `node` of a function or method named `name` (`f(...)`, `x.f(...)`, `x.f.apply(...)`)."""
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func.value if isinstance(call.func, ast.Attribute) and call.func.attr == "apply" else call.func
            if (isinstance(func, ast.Name) and func.id == name) or (isinstance(func, ast.Attribute)
                                                                    and func.attr == name):
                found.append(call)
    return found


def mentions(node: ast.AST | None, name: str) -> bool:
    """Whether `node` reads a variable or attribute called `name`."""
    return node is not None and any((isinstance(n, ast.Name) and n.id == name)
                                    or (isinstance(n, ast.Attribute) and n.attr == name) for n in ast.walk(node))


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    """Each node's parent."""
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def enclosing_ifs(node: ast.AST, up: dict[ast.AST, ast.AST]) -> Iterator[ast.If]:
    """The `if` statements around `node`, innermost first (in their body or their else branch)."""
    child = node
    while child in up:
        parent = up[child]
        if isinstance(parent, ast.If) and child is not parent.test:
            yield parent
        child = parent


def condition_of(node: ast.AST, up: dict[ast.AST, ast.AST]) -> tuple[ast.If | None, str]:
    """The innermost `if` around `node` and the condition under which `node` runs, as text (`not (...)` in an
    else branch)."""
    test = next(enclosing_ifs(node, up), None)
    if test is None:
        return None, ""
    in_else = any(node is n for stmt in test.orelse for n in ast.walk(stmt))
    return test, f"not ({ast.unparse(test.test)})" if in_else else ast.unparse(test.test)


def literal(node: ast.AST | None) -> Any:
    """A literal's value; otherwise the expression's text, marked as such."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return {"expr": ast.unparse(node)}


# --- GRPOConfig and TrainingArguments -------------------------------------------------------------------------------

def config_chain(src: WheelSource) -> list[tuple[str, ast.ClassDef]]:
    """GRPOConfig and the TRL classes it inherits from, down to transformers' TrainingArguments."""
    chain, module, name = [], *CONFIG
    while (found := resolve(src, module, name, ast.ClassDef)) is not None:
        module, cls = found
        chain.append((module, cls))
        name = ast.unparse(cls.bases[0]).split(".")[-1]
        if name == "TrainingArguments":
            break
    return chain


def class_fields(cls: ast.ClassDef) -> dict[str, ast.AST | None]:
    """A dataclass's fields and the node of each default (`field(default=...)` or a plain default)."""
    fields = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            value = stmt.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
                value = next((k.value for k in value.keywords if k.arg in ("default", "default_factory")), None)
            fields[stmt.target.id] = value
    return fields


def class_variable(cls: ast.ClassDef, name: str) -> list[tuple[str, ast.AST]]:
    """Assignments to a class-body variable (e.g. transformers' `default_optim`), with the condition of each."""
    found = []

    def visit(body: list[ast.stmt], conditions: list[str]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                found.append((" and ".join(conditions), stmt.value))
            elif isinstance(stmt, ast.If):
                visit(stmt.body, [*conditions, ast.unparse(stmt.test)])
    visit(cls.body, [])
    return found


def torch_condition(text: str) -> bool | None:
    """Whether a condition on torch holds for CURRENT_TORCH; None when it is not one we can read."""
    parts = [p.strip() for p in text.split(" and ") if p.strip()]
    results = []
    for part in parts:
        if part == "is_torch_available()":
            results.append(True)
        elif part.startswith("is_torch_greater_or_equal_than_"):
            results.append(CURRENT_TORCH >= Version(part.removeprefix("is_torch_greater_or_equal_than_")
                                                    .replace("_", ".")))
        else:
            return None
    return all(results)


def computed_default(cls: ast.ClassDef, node: ast.AST) -> dict[str, Any]:
    """A default that is a class variable: its assignments in order and what they give for CURRENT_TORCH."""
    assignments = class_variable(cls, node.id) if isinstance(node, ast.Name) else []
    if not assignments:
        return {"value": None, "expr": ast.unparse(node)}
    value, steps = None, []
    for condition, expr in assignments:
        steps.append(f"if {condition}: {ast.unparse(expr)}" if condition else ast.unparse(expr))
        holds = torch_condition(condition) if condition else True
        if holds is None:
            return {"value": None, "expr": "; ".join(steps), "unresolved": condition}
        if holds:
            value = ast.literal_eval(expr)
    return {"value": value, "expr": f"{node.id} = " + "; ".join(steps), "for_torch": str(CURRENT_TORCH)}


def none_resolutions(func: ast.FunctionDef | None) -> dict[str, str]:
    """What `__post_init__` sets a field to when it was left None: `self.x = a if self.x is None else self.x` and
    `if self.x is None: self.x = a` (also inside compound tests)."""
    found: dict[str, str] = {}
    if func is None:
        return found
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp):
            target, test = ast.unparse(node.targets[0]), node.value.test
            if ast.unparse(test) == f"{target} is None":
                found.setdefault(target.removeprefix("self."), ast.unparse(node.value.body))
        elif isinstance(node, ast.If):
            tested = {ast.unparse(c.left) for c in ast.walk(node.test) if isinstance(c, ast.Compare)
                      and isinstance(c.ops[0], ast.Is) and ast.unparse(c.comparators[0]) == "None"}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) in tested:
                    found.setdefault(ast.unparse(stmt.targets[0]).removeprefix("self."), ast.unparse(stmt.value))
    return found


def defaults(chain: list[tuple[str, ast.ClassDef]], training_args: ast.ClassDef) -> dict:
    """Each knob of FIELDS: the class that sets its default ("in": GRPOConfig, a TRL base class, or the
    transformers release of the time's TrainingArguments; None when no class has the field), the default, and what
    __post_init__ makes of a None."""
    resolutions = none_resolutions(method(training_args, "__post_init__"))
    for _, cls in reversed(chain):  # a subclass's __post_init__ runs first, so its resolution wins
        resolutions.update(none_resolutions(method(cls, "__post_init__")))
    base_fields = class_fields(training_args)
    result = {}
    for name in FIELDS:
        owner = next(((cls.name, cls) for _, cls in chain if name in class_fields(cls)), None)
        if owner is None and name in base_fields:
            owner = ("TrainingArguments", training_args)
        if owner is None:
            result[name] = {"in": None}
            continue
        node = class_fields(owner[1])[name]
        entry: dict[str, Any] = {"in": owner[0]}
        try:
            entry["value"] = ast.literal_eval(node) if node is not None else None
        except (ValueError, TypeError, SyntaxError):
            entry.update(computed_default(owner[1], node))
        if entry.get("value") is None and name in resolutions:
            entry["if_none"] = resolutions[name]
        result[name] = entry
    return result


# --- The trainer's rules on num_generations and the batch -----------------------------------------------------------

def assigned(func: ast.FunctionDef, name: str, before: int) -> ast.AST | None:
    """The value last assigned to a local variable before line `before`."""
    values = [n.value for n in ast.walk(func) if isinstance(n, ast.Assign) and n.lineno < before
              and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return values[-1] if values else None


def divided_quantity(func: ast.FunctionDef, test: ast.AST) -> tuple[str | None, int | None]:
    """The quantity an `if` on num_generations requires divisible by it (its expression), and the smallest
    num_generations it allows (2 when it rejects 1)."""
    if not isinstance(test, ast.Compare):
        return None, None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, ast.Lt) and mentions(left, "num_generations") and literal(right) == 2:
        return None, 2
    if isinstance(op, ast.NotIn) and mentions(left, "num_generations") and isinstance(right, ast.Name):
        # `n not in [n for n in range(2, X + 1) if X % n == 0]`
        comprehension = assigned(func, right.id, test.lineno)
        if isinstance(comprehension, ast.ListComp) and comprehension.generators[0].ifs:
            generator = comprehension.generators[0]
            divisible = generator.ifs[0]
            if isinstance(divisible, ast.Compare) and isinstance(divisible.left, ast.BinOp):
                return expand(func, divisible.left.left, test.lineno), literal(generator.iter.args[0])
    if isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod) and mentions(left.right, "num_generations"):
        return expand(func, left.left, test.lineno), None  # `X % num_generations != 0`
    return None, None


def expand(func: ast.FunctionDef, node: ast.AST | None, before: int) -> str | None:
    """An expression's text, with a local variable replaced by what was assigned to it."""
    if isinstance(node, ast.Name):
        value = assigned(func, node.id, before)
        if value is not None:
            return ast.unparse(value)
    return ast.unparse(node) if node is not None else None


def quantity_kind(expression: str) -> str:
    """Which batch an expression is: the table's num_generations_rule words."""
    if "generation_batch_size" in expression:
        return "generation_batch"
    if "gradient_accumulation_steps" in expression or "steps_per_generation" in expression:
        return "effective_batch"
    return "global_batch"


def batch_rules(functions: list[tuple[str, ast.FunctionDef]]) -> dict[str, Any]:
    """Every `raise ValueError` on generations or the batch size, and what must be divisible by num_generations."""
    errors, divides, minimum = [], [], None
    for where, func in functions:
        up = parents(func)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and ast.unparse(node.exc.func) == "ValueError" and node.exc.args):
                continue
            message = ast.unparse(node.exc.args[0])
            if "generation" not in message.lower() and "batch size" not in message.lower():
                continue
            test, condition = condition_of(node, up)
            errors.append({"in": where, "if": condition, "message": message})
            if test is None or condition.startswith("not (") or "eval" in message:
                continue  # the evaluation batch's rule does not bind training
            quantity, low = divided_quantity(func, test.test)
            minimum = low or minimum
            if quantity is not None:
                divides.append(quantity)
    kinds = sorted({quantity_kind(q) for q in divides})
    return {"num_generations_divides": "+".join(kinds) or "none", "divides_expr": " / ".join(divides) or None,
            "num_generations_min": minimum, "errors": errors}


# --- How the trainer spends memory ----------------------------------------------------------------------------------

def batch_counts(trainer: ast.ClassDef) -> str:
    """"completions" when the sampler repeats each prompt num_generations times, "prompts" when generation returns
    num_generations sequences per prompt of the micro-batch."""
    sampler = method(trainer, "_get_train_sampler")
    if sampler is not None and any("Repeat" in ast.unparse(c.func) and mentions(c, "num_generations")
                                   for c in ast.walk(sampler) if isinstance(c, ast.Call)):
        return "completions"
    for call in calls(trainer, "GenerationConfig"):
        if any(k.arg == "num_return_sequences" and mentions(k.value, "num_generations") for k in call.keywords):
            return "prompts"
    return "unknown"


def generation_batch(trainer: ast.ClassDef) -> tuple[str, str | None]:
    """"accumulation" when _prepare_inputs splits one generation into several micro-batches (and into how many),
    else "micro_batch"."""
    prepare = method(trainer, "_prepare_inputs")
    splits = calls(prepare, "split_tensor_dict") if prepare is not None else []
    if splits:
        return "accumulation", ast.unparse(splits[0].args[1])
    return "micro_batch", None


def liger(trainer: ast.ClassDef) -> tuple[str, str | None]:
    """What use_liger_kernel does in GRPO, and which flag turns on a fused GRPO loss (None when none does).

    "fused_loss": a `*FusedLinearGRPOLoss` (Liger's, or TRL's copy of it) built under `if ...use_liger_kernel`;
    "chunked_logprobs": the trainer itself runs TRL's ChunkedLogProbFunction and reads use_liger_kernel;
    "layer_kernels": neither, so only transformers' Trainer acts on the flag (Liger's RMSNorm/SwiGLU/RoPE kernels;
    its fused cross-entropy needs labels, which GRPO's forward does not pass).
    """
    up = parents(trainer)
    fused_flag = None
    for call in ast.walk(trainer):
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("FusedLinearGRPOLoss"):
            tests = [ast.unparse(i.test) for i in enclosing_ifs(call, up)]
            flags = ("use_liger_kernel", "use_liger_loss")
            fused_flag = next((f for f in flags if any(f in t for t in tests)), fused_flag)
    if fused_flag == "use_liger_kernel":
        return "fused_loss", fused_flag
    chunked = calls(trainer, "_ChunkedLogProbFunction") + calls(trainer, "ChunkedLogProbFunction")
    if chunked and mentions(trainer, "use_liger_kernel"):
        return "chunked_logprobs", fused_flag
    return "layer_kernels", fused_flag


def fused_lm_head(src: WheelSource, trainer: ast.ClassDef) -> dict[str, Any] | None:
    """When __init__ patches the model with the fused chunked LM head whatever the flags: its tile sizes."""
    init, up = method(trainer, "__init__"), parents(trainer)
    patches = [c for c in calls(init, "add_fused_lm_head")
               if not any(mentions(i.test, "use_liger_kernel") for i in enclosing_ifs(c, up))]
    if not patches:
        return None
    module, patch = resolve(src, TRAINER[0], "add_fused_lm_head", ast.FunctionDef)
    constants = module_constants(src, module)
    # The vocabulary width is the module constant the patch passes to ChunkedLogProbFunction.apply; the token tile
    # is a constant of the kernel's own module.
    applies = [(name, c) for name in ("ChunkedLogProbFunction", "_ChunkedLogProbFunction") for c in calls(patch, name)]
    passed = [constants[a.id] for _, c in applies for a in c.args if isinstance(a, ast.Name) and a.id in constants]
    kernel = resolve(src, module, applies[0][0], ast.ClassDef) if applies else None
    return {"token_chunk": module_constants(src, kernel[0]).get("TOKEN_CHUNK_SIZE") if kernel else None,
            "vocab_chunk": passed[0] if passed else None}


def module_constants(src: WheelSource, module: str) -> dict[str, int]:
    """Module-level integer constants."""
    tree = src.module(module)
    return {t.id: s.value.value for s in (tree.body if tree else []) if isinstance(s, ast.Assign)
            and isinstance(s.value, ast.Constant) and isinstance(s.value.value, int)
            for t in s.targets if isinstance(t, ast.Name)}


def log_probs(trainer: ast.ClassDef, lm_head: dict | None) -> str:
    """How per-token log-probs are computed: the fused LM head, selective_log_softmax, or a log_softmax per row."""
    if lm_head is not None:
        return "fused_lm_head"
    if calls(trainer, "selective_log_softmax"):
        return "selective_log_softmax"
    loops = [n for n in ast.walk(trainer) if isinstance(n, ast.For) and calls(n, "log_softmax")]
    return "per_row_log_softmax" if loops else "unknown"


def _log_prob_function(trainer: ast.ClassDef) -> ast.FunctionDef | None:
    """The innermost function that calls a log-softmax: a method (`_get_per_token_logps`, 1.14's
    `_full_logits_logps`) or 0.14's `get_per_token_logps` nested in compute_loss; None with the fused head."""
    softmaxes = ("log_softmax", "selective_log_softmax", "selective_log_softmax_and_entropy")
    found = [f for f in ast.walk(trainer) if isinstance(f, ast.FunctionDef) and any(calls(f, n) for n in softmaxes)]
    return found[-1] if found else None


def full_logits_log_probs(trainer: ast.ClassDef, lm_head: dict | None) -> str | None:
    """How the log-prob method turns full logits into log-probs, in profiles/trl.toml's words (None with the fused
    head): "kernel" (a log-softmax kernel that takes the temperature and scales inside), "scaled_in_place"
    (`logits.div_(temperature)`), "scaled_copy" (`logits = logits / temperature`), "scaled_copy_beside_output" (the
    same while a name still holds the model's output, so its logits outlive the copy), "rows" (no scaling)."""
    if lm_head is not None:
        return None
    func = _log_prob_function(trainer)
    if func is None:
        return "unknown"
    if calls(func, "selective_log_softmax_and_entropy"):
        return "kernel"
    if any(mentions(c, "temperature") for c in calls(func, "div_")):
        return "scaled_in_place"
    if not any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and mentions(n.right, "temperature")
               for n in ast.walk(func)):
        return "rows"
    # `outputs = model(...)` then `logits = outputs.logits`: the output object keeps the unscaled logits alive
    outputs = {t.id for n in ast.walk(func) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               for t in n.targets if isinstance(t, ast.Name)}
    beside = any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and n.value.attr == "logits"
                 and isinstance(n.value.value, ast.Name) and n.value.value.id in outputs for n in ast.walk(func))
    return "scaled_copy_beside_output" if beside else "scaled_copy"


def logits_to_keep_argument(trainer: ast.ClassDef, lm_head: dict | None) -> str | None:
    """The keyword the log-prob method asks the model's forward for the completion's logits only with
    (`model(..., num_logits_to_keep=...)` or `model_inputs["logits_to_keep"] = ...`); None with the fused head."""
    if lm_head is not None:
        return None
    names = ("num_logits_to_keep", "logits_to_keep")
    for node in ast.walk(trainer):
        if isinstance(node, ast.keyword) and node.arg in names:
            return node.arg
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and literal(node.slice) in names:
            return literal(node.slice)
    return "unknown"


def log_prob_attention_mask(trainer: ast.ClassDef) -> str:
    """"passed" where the log-prob method hands the model the batch's attention mask, "none" where it calls it with
    the token ids alone (0.14's `model(input_ids, num_logits_to_keep=...)`)."""
    func = _log_prob_function(trainer) or method(trainer, "_get_per_token_logps_and_entropies")
    return "passed" if mentions(func, "attention_mask") or "attention_mask" in ast.unparse(func) else "none"


def log_prob_forward_cache(trainer: ast.ClassDef, lm_head: dict | None) -> str:
    """"off" where the log-prob forward passes use_cache=False (`model_inputs["use_cache"] = False` or the keyword;
    the fused head sets it itself), else "model_default" (the model's config.use_cache)."""
    if lm_head is not None:
        return "off"
    for node in ast.walk(trainer):
        if isinstance(node, ast.keyword) and node.arg == "use_cache" and literal(node.value) is False:
            return "off"
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) and \
                literal(node.targets[0].slice) == "use_cache" and literal(node.value) is False:
            return "off"
    return "model_default"


def prompt_truncation(src: WheelSource, trainer: ast.ClassDef) -> str:
    """Which side max_prompt_length cuts prompts from: "left", "none" (the trainer never reads it) or "unknown"."""
    if not mentions(trainer, "max_prompt_length"):
        return "none"
    for node in ast.walk(trainer):
        if isinstance(node, ast.Slice) and isinstance(node.lower, ast.UnaryOp) and \
                isinstance(node.lower.op, ast.USub) and mentions(node.lower, "max_prompt_length"):
            return "left"  # x[:, -max_prompt_length:] keeps the last tokens
        if isinstance(node, ast.keyword) and node.arg == "truncation_side":
            return ast.literal_eval(node.value)
        if isinstance(node, ast.Call) and any(mentions(a, "max_prompt_length") for a in node.args) and \
                isinstance(node.func, ast.Name) and keeps_last(src, node.func.id):
            return "left"
    return "unknown"


def keeps_last(src: WheelSource, name: str) -> bool:
    """Whether a truncation helper keeps the rightmost tokens (`x[-n:]`)."""
    found = resolve(src, TRAINER[0], name, ast.FunctionDef)
    return found is not None and any(isinstance(n, ast.Slice) and isinstance(n.lower, ast.UnaryOp)
                                     and n.upper is None for n in ast.walk(found[1]))


def old_logps_when(trainer: ast.ClassDef) -> tuple[str, str | None]:
    """When the old policy's log-probs get their own no-grad pass, in the table's words, and the condition."""
    up = parents(trainer)
    for node in ast.walk(trainer):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                "old_per_token_logps" in ast.unparse(node.targets[0]) and \
                "_get_per_token_logps" in ast.unparse(node.value.func):
            condition = condition_of(node, up)[1]
            if "gradient_accumulation_steps %" in condition:
                return ("off_policy_or_vllm" if "use_vllm" in condition else "off_policy"), condition
            if "steps_per_generation" in condition:
                return "num_iterations_or_more_steps", condition
            return ("num_iterations" if "num_iterations" in condition else "always"), condition
    return "never", None


def reference_when(trainer: ast.ClassDef) -> str:
    """"beta_nonzero" when __init__ drops the reference model for beta == 0, else "always"."""
    for node in ast.walk(method(trainer, "__init__")):
        if isinstance(node, ast.If) and mentions(node.test, "beta") and "== 0" in ast.unparse(node.test) and \
                any(ast.unparse(s) == "self.ref_model = None" for s in node.body):
            return "beta_nonzero"
    return "always"


def model_dtype(src: WheelSource, trainer: ast.ClassDef) -> str:
    """The dtype TRL passes to from_pretrained when model_init_kwargs has none: the literal default of its
    `.get("dtype")`/`.get("torch_dtype")` (in __init__ or in the create_model_from_path it calls), or "unset"."""
    init = method(trainer, "__init__")
    loader = resolve(src, TRAINER[0], "create_model_from_path", ast.FunctionDef) \
        if calls(init, "create_model_from_path") else None
    for place in ([loader[1]] if loader else []) + [init]:  # the loader first: __init__ may read a reward model's
        for call in calls(place, "get"):
            if call.args and literal(call.args[0]) in ("dtype", "torch_dtype"):
                default = literal(call.args[1]) if len(call.args) > 1 else None
                return default if default not in (None, "auto") else "unset"
    return "unset"


def training_entropy(src: WheelSource, trainer: ast.ClassDef) -> str:
    """How the loss pass turns full logits into the completion's entropies, in profiles/trl.toml's words: "none" where
    the trainer never calls `entropy_from_logits` (before 0.20; 1.14's kernel and 1.15's fused head compute them
    inside), "flat_rows" where that function reshapes the logits to rows of the vocabulary and takes them a chunk
    at a time (0.23 on), "per_sequence" where it splits the batch (0.20-0.22)."""
    if not calls(trainer, "entropy_from_logits"):
        return "none"
    found = resolve(src, TRAINER[0], "entropy_from_logits", ast.FunctionDef)
    if found is None:
        return "unknown"
    return "flat_rows" if calls(found[1], "reshape") else "per_sequence"


def zero3_trace_kept_across_generation(src: WheelSource) -> bool:
    """Whether TRL's gathered generation under ZeRO-3 leaves DeepSpeed's parameter coordinator trace as it was: its
    `add_hooks` (trl/models/utils.py, which puts the modules' hooks back after generating) calls no
    `_invalidate_trace` (before 1.5)."""
    found = resolve(src, "trl.models.utils", "add_hooks", ast.FunctionDef)
    return found is not None and not calls(found[1], "_invalidate_trace")


def calls_through(src: WheelSource, module: str, node: ast.AST, name: str, depth: int = 2) -> bool:
    """Whether `node` calls `name`, itself or through the wheel's functions it calls by name, `depth` levels down."""
    if calls(node, name):
        return True
    called = sorted({c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)})
    found = [resolve(src, module, f, ast.FunctionDef) for f in called] if depth else []
    return any(calls_through(src, where, function, name, depth - 1) for where, function in filter(None, found))


def checkpointing_input_grads(src: WheelSource, trainer: ast.ClassDef) -> bool:
    """Whether the trainer's set-up calls `enable_input_require_grads` (itself from 0.26, through
    trl/models/utils.py's prepare_peft_model and enable_gradient_checkpointing in 0.22-0.25; before 0.16 never)."""
    return calls_through(src, TRAINER[0], trainer, "enable_input_require_grads")


def _use_reentrant_set(node: ast.AST | None, value: bool) -> bool:
    """Whether `node` sets `use_reentrant` to `value`: `kwargs.setdefault("use_reentrant", value)` or
    `kwargs["use_reentrant"] = value`."""
    if node is None:
        return False
    default = any(len(c.args) == 2 and literal(c.args[0]) == "use_reentrant" and literal(c.args[1]) is value
                  for c in calls(node, "setdefault"))
    assigned = any(isinstance(n, ast.Assign) and literal(n.value) is value and any(
        isinstance(t, ast.Subscript) and literal(t.slice) == "use_reentrant" for t in n.targets)
        for n in ast.walk(node))
    return default or assigned


def non_reentrant_by_default(src: WheelSource, trainer: ast.ClassDef) -> bool:
    """Whether GRPOConfig.__post_init__ (0.27) or the trainer's __init__ (0.28 on) sets `use_reentrant` False where the
    user left it unset; before, transformers 4's gradient_checkpointing_enable ran with its own default,
    {"use_reentrant": True} (transformers 5 defaults to False)."""
    places = [method(cls, "__post_init__") for _, cls in config_chain(src)] + [method(trainer, "__init__")]
    return any(_use_reentrant_set(place, False) for place in places)


def peft_zero3_reentrant(trainer: ast.ClassDef) -> bool:
    """Whether the trainer forces `use_reentrant` True for PEFT under DeepSpeed ZeRO-3 with checkpointing
    (`args.gradient_checkpointing_kwargs["use_reentrant"] = True`, 1.9 on)."""
    return _use_reentrant_set(method(trainer, "__init__"), True)


def qlora_setup(src: WheelSource, trainer: ast.ClassDef) -> str:
    """How the trainer sets a 4-bit model up for LoRA: through PEFT's `prepare_model_for_kbit_training` (trl/models/
    utils.py's prepare_peft_model, 0.22-0.25), by casting the parameters' data to bfloat16 itself
    (`param.data = param.data.to(torch.bfloat16)` in __init__, 0.26 on), or neither."""
    if calls_through(src, TRAINER[0], trainer, "prepare_model_for_kbit_training"):
        return "prepare_kbit_training"
    for node in ast.walk(method(trainer, "__init__")):
        to_data = isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "data"
                                                       for t in node.targets)
        if to_data and calls(node.value, "to") and mentions(node.value, "bfloat16"):
            return "bf16_adapters"
    return "peft_default"


def behaviour(src: WheelSource, trainer: ast.ClassDef) -> dict[str, Any]:
    """The markers of grpo_trainer.py that decide memory."""
    compute_loss = method(trainer, "compute_loss")
    lm_head = fused_lm_head(src, trainer)
    liger_effect, liger_loss_flag = liger(trainer)
    split, split_by = generation_batch(trainer)
    old_logps, old_logps_if = old_logps_when(trainer)
    return {
        "generate_in_compute_loss": bool(calls(compute_loss, "generate")),
        "batch_counts": batch_counts(trainer),
        "generation_batch": split, "generation_split_by": split_by,
        "lm_head": "fused_chunked" if lm_head else "full_logits", "fused_lm_head_tiles": lm_head,
        "log_probs": log_probs(trainer, lm_head),
        "full_logits_log_probs": full_logits_log_probs(trainer, lm_head),
        "logits_to_keep_argument": logits_to_keep_argument(trainer, lm_head),
        "log_prob_forward_cache": log_prob_forward_cache(trainer, lm_head),
        "log_prob_attention_mask": log_prob_attention_mask(trainer),
        "use_liger_kernel": liger_effect, "liger_fused_loss_flag": liger_loss_flag,
        "prompt_truncation": prompt_truncation(src, trainer),
        "old_logps_when": old_logps, "old_logps_if": old_logps_if,
        "reference_when": reference_when(trainer),
        "model_dtype_passed": model_dtype(src, trainer),
        "training_entropy": training_entropy(src, trainer),
        "zero3_trace_kept_across_generation": zero3_trace_kept_across_generation(src),
        "enables_input_require_grads": checkpointing_input_grads(src, trainer),
        "non_reentrant_by_default": non_reentrant_by_default(src, trainer),
        "peft_zero3_reentrant": peft_zero3_reentrant(trainer),
        "qlora_setup": qlora_setup(src, trainer),
    }


# --- One release ----------------------------------------------------------------------------------------------------

def generation_defaults(tf_src: WheelSource) -> dict[str, Any]:
    """GenerationConfig's defaults of the sampling knobs: `self.top_k = kwargs.pop("top_k", 50)` in its __init__
    (transformers 4; None from 5.0, where generate() applies no filter it is not given)."""
    cls = top_level(tf_src.module("transformers.generation.configuration_utils"), ast.ClassDef, "GenerationConfig")
    found = {}
    for call in calls(method(cls, "__init__"), "pop"):
        if len(call.args) == 2 and literal(call.args[0]) in GENERATION_FIELDS:
            found[literal(call.args[0])] = literal(call.args[1])
    return {name: found.get(name) for name in GENERATION_FIELDS}


def release_facts(trl: Wheel, transformers: dict[str, Wheel], cache: Path) -> dict[str, Any]:
    """Everything read from one TRL release's wheel (and the transformers wheel of its time)."""
    src = WheelSource(downloaded(trl, cache))
    spec = src.requirements.get("transformers", "")
    tf_wheel = transformers_of_the_time(trl, spec, transformers)
    tf_src = WheelSource(downloaded(tf_wheel, cache))
    training_args = top_level(tf_src.module("transformers.training_args"), ast.ClassDef, "TrainingArguments")
    chain = config_chain(src)
    trainer = resolve(src, *TRAINER, ast.ClassDef)[1]
    functions = [(f"{cls.name}.__post_init__", method(cls, "__post_init__")) for _, cls in chain]
    functions.append((f"{trainer.name}.__init__", method(trainer, "__init__")))
    return {
        "version": trl.version,
        "prerelease": Version(trl.version).is_prerelease,
        "uploaded": trl.uploaded.isoformat().replace("+00:00", "Z"),
        "wheel": {"filename": trl.filename, "sha256": trl.sha256},
        "requires": {"transformers": spec, "accelerate": src.requirements.get("accelerate", "")},
        "transformers": {"version": tf_wheel.version, "major": Version(tf_wheel.version).major,
                         "uploaded": tf_wheel.uploaded.isoformat().replace("+00:00", "Z"), "sha256": tf_wheel.sha256},
        "config_classes": [f"{module}.{cls.name}" for module, cls in chain],
        # the fields a recipe of this release may name (GRPOConfig's own and ModelConfig's; TrainingArguments' are
        # transformers')
        "fields": sorted({name for _, cls in chain for name in class_fields(cls)}
                         | set(class_fields(resolve(src, "trl", "ModelConfig", ast.ClassDef)[1]))),
        "defaults": defaults(chain, training_args),
        "generation_defaults": generation_defaults(tf_src),
        "rules": batch_rules([(w, f) for w, f in functions if f is not None]),
        "behaviour": behaviour(src, trainer),
    }


def extract(cache: Path) -> dict[str, Any]:
    """The facts of every release from OLDEST to NEWEST that PyPI lists."""
    (listed, trl), (_, transformers) = pypi_releases("trl"), pypi_releases("transformers")
    versions = [v for v in listed if OLDEST <= Version(v) <= NEWEST]
    releases = []
    for version in versions:
        print(f"trl {version}", file=sys.stderr)
        if version not in trl:
            raise SystemExit(f"error: PyPI lists trl {version} without a py3-none-any wheel; read its sdist by hand")
        releases.append(release_facts(trl[version], transformers, cache))
    return {
        "made": date.today().isoformat(),
        "source": {"trl": PYPI_JSON.format(project="trl"), "transformers": PYPI_JSON.format(project="transformers"),
                   "wheels": "pip download --no-deps trl==X / transformers==Y, checked against PyPI's sha256"},
        "current_torch": str(CURRENT_TORCH),
        "pypi_releases": versions,
        "releases": releases,
    }


# --- The table's columns from the facts -----------------------------------------------------------------------------

def default(name: str) -> Callable[[dict], Any]:
    """A knob's default as read (None where the field is missing or defaults to None)."""
    return lambda facts: facts["defaults"][name].get("value")


def mixed_precision(facts: dict) -> str:
    """"bf16" when bf16 is on by default where the card supports it (None resolved to `not self.fp16`), else "no"."""
    bf16 = facts["defaults"]["bf16"]
    if bf16.get("value") is True or (bf16.get("value") is None and bf16.get("if_none") == "not self.fp16"):
        return "bf16"
    return "no"


def vllm_mode(facts: dict) -> str:
    """The vllm_mode default; before the field existed vLLM ran apart from training (vllm_device's own GPU or
    `trl vllm-serve`), which is the table's "server"."""
    return facts["defaults"]["vllm_mode"].get("value") or "server"


def model_dtype_column(facts: dict) -> str:
    """The dtype a model named by string is loaded in: TRL's own default, else from_pretrained's of the
    transformers of the time (float32 in 4.x; the checkpoint's own, "auto", from 5.0)."""
    passed = facts["behaviour"]["model_dtype_passed"]
    if passed != "unset":
        return passed
    return "float32" if facts["transformers"]["major"] == 4 else "auto"


def sampling_default(name: str) -> Callable[[dict], Any]:
    """What generate() applies for a sampling knob left unset: GRPOConfig's default where it has the field, else
    GenerationConfig's of the transformers of the time; "no filter" (top_k None or 0, min_p None) is the table's 0
    and None alike."""
    def column(facts: dict) -> Any:
        entry = facts["defaults"][name]
        value = entry.get("value") if entry["in"] is not None else facts["generation_defaults"][name]
        return 0 if name == "top_k" and value is None else value
    return column


def tile(key: str) -> Callable[[dict], Any]:
    """A fused LM head's tile size; rows without the fused head are not compared."""
    return lambda facts: (facts["behaviour"]["fused_lm_head_tiles"] or {}).get(key, SKIP)


SKIP = object()  # a column these facts do not determine
COLUMNS: dict[str, Callable[[dict], Any]] = {
    "default_per_device_train_batch_size": default("per_device_train_batch_size"),
    "default_gradient_accumulation_steps": default("gradient_accumulation_steps"),
    "default_gradient_checkpointing": default("gradient_checkpointing"),
    "default_mixed_precision": mixed_precision,
    "default_beta": default("beta"),
    "default_max_prompt_length": default("max_prompt_length"),
    "accepts_max_prompt_length": lambda f: f["defaults"]["max_prompt_length"]["in"] is not None,
    "truncates_prompts": lambda f: f["behaviour"]["prompt_truncation"] == "left",
    "accepts_vllm_mode": lambda f: f["defaults"]["vllm_mode"]["in"] is not None,
    "accepts_steps_per_generation": lambda f: f["defaults"]["steps_per_generation"]["in"] is not None,
    "default_max_completion_length": default("max_completion_length"),
    "default_vllm_mode": vllm_mode,
    "default_vllm_gpu_memory_utilization": default("vllm_gpu_memory_utilization"),
    "default_optim": default("optim"),
    "default_temperature": sampling_default("temperature"),
    "default_top_k": sampling_default("top_k"),
    "accepts_sampling_filters": lambda f: all(f["defaults"][name]["in"] is not None
                                              for name in ("top_p", "top_k", "min_p", "repetition_penalty")),
    "default_model_dtype": model_dtype_column,
    "batch_counts": lambda f: f["behaviour"]["batch_counts"],
    "generation_batch": lambda f: f["behaviour"]["generation_batch"],
    "num_generations_rule": lambda f: f["rules"]["num_generations_divides"],
    "old_logps_when": lambda f: f["behaviour"]["old_logps_when"],
    "reference_when": lambda f: f["behaviour"]["reference_when"],
    "step_structure": lambda f: "loss_merged" if f["behaviour"]["generate_in_compute_loss"] else "phased",
    "transformers_major": lambda f: f["transformers"]["major"],
    "lm_head": lambda f: f["behaviour"]["lm_head"],
    "lm_head_token_chunk": tile("token_chunk"),
    "lm_head_vocab_chunk": tile("vocab_chunk"),
    "liger": lambda f: f["behaviour"]["use_liger_kernel"],
    # rows with the fused head (None) are not compared
    "full_logits_log_probs": lambda f: f["behaviour"]["full_logits_log_probs"] or SKIP,
    "logits_to_keep_argument": lambda f: f["behaviour"]["logits_to_keep_argument"] or SKIP,
    "log_prob_forward_cache": lambda f: f["behaviour"]["log_prob_forward_cache"],
    "log_prob_attention_mask": lambda f: f["behaviour"]["log_prob_attention_mask"],
    "training_entropy": lambda f: f["behaviour"]["training_entropy"],
    "zero3_trace_kept_across_generation": lambda f: f["behaviour"]["zero3_trace_kept_across_generation"],
    "checkpointing_input_grads": lambda f: f["behaviour"]["enables_input_require_grads"],
    # transformers 4's gradient_checkpointing_enable defaults to reentrant, 5's not
    "checkpointing_reentrant": lambda f: (f["transformers"]["major"] == 4
                                          and not f["behaviour"]["non_reentrant_by_default"]),
    "peft_zero3_reentrant": lambda f: f["behaviour"]["peft_zero3_reentrant"],
    "qlora_setup": lambda f: f["behaviour"]["qlora_setup"],
}


def disagreements(document: dict[str, Any]) -> list[str]:
    """One line per (release, column) where profiles/trl.toml says something else than the release's facts."""
    lines = []
    for facts in document["releases"]:
        try:
            row = trl_release(facts["version"])
        except VramPlanError as error:
            lines.append(f"{facts['version']}: no row: {error}")
            continue
        for column, fact_of in COLUMNS.items():
            fact = fact_of(facts)
            if fact is SKIP:
                continue
            if column not in field_names(TrlRelease):
                lines.append(f"{facts['version']}: {column}: table has no such column, fact {fact!r}")
            elif getattr(row, column) != fact:
                lines.append(f"{facts['version']}: {column}: table {getattr(row, column)!r}, fact {fact!r}")
    return lines


def compact_json(value: Any, indent: str = "") -> str:
    """JSON with one item a line, and an object or list that fits in 100 columns on its own line."""
    flat = json.dumps(value)
    if not isinstance(value, (dict, list)) or len(indent) + len(flat) <= 100:
        return flat
    inner = indent + " "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + compact_json(v, inner) for v in value) + f"\n{indent}]"


def load_facts(path: Path = RESULTS) -> dict[str, Any]:
    """The committed facts."""
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel cache (default {DEFAULT_CACHE})")
    parser.add_argument("--check", action="store_true",
                        help="only compare profiles/trl.toml with the committed facts (no download)")
    args = parser.parse_args()
    if not args.check:
        write_atomically(RESULTS, compact_json(extract(args.cache)) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    lines = disagreements(load_facts())
    print("\n".join(lines) if lines else "profiles/trl.toml agrees with every release's facts")
    sys.exit(1 if lines else 0)


if __name__ == "__main__":
    main()
