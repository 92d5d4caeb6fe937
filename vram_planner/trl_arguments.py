"""TRL's own command-line arguments (`--use_peft --lora_r 16 --bf16 true`, as `trl grpo` and TRL's scripts take them,
HfArgumentParser's), parsed as TRL's parser parses them, for a recipe's reading (vram_planner.recipe): what a user
pastes from the command that trains. Pure Python.

An option whose name, dashes read as underscores, is one of TRL's arguments (trl_names), or `--no_X` for a boolean X,
is TRL's, unless the command knows it as its own. A boolean takes no value (true) or one of yes/no, true/false, t/f,
y/n, 1/0; a list argument one or more values; every other one value, a number where it reads as one, JSON where it
is a mapping (TrainingArguments reads `--gradient_checkpointing_kwargs '{"use_reentrant": false}'` so). An option of
accelerate launch's (`--num_processes 8`, `--use_deepspeed`, TRL's `--accelerate_config zero3`) is the launcher's, as
`trl grpo` hands the options its parser does not know to accelerate (trl/cli/commands/training.py): its switches take
no value, the rest one (vram_planner.launcher reads them). Any other option is left to the command.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.launcher import LAUNCH_FLAGS, default_accelerate_config, is_launch_option, torchrun_options
from vram_planner.trl_names import BOOLEAN_ARGUMENTS, LIST_ARGUMENTS, SHARED_ARGUMENTS, TRL_ARGUMENTS

# transformers' string_to_bool
TRUTH = {"yes": True, "true": True, "t": True, "y": True, "1": True,
         "no": False, "false": False, "f": False, "n": False, "0": False}
# ModelConfig.__post_init__ makes a list of one target the name itself (PEFT reads "all-linear" only as a string)
ONE_IS_THE_NAME = frozenset({"lora_target_modules"})


def split_trl_arguments(args: list[str], known: set[str], trl: bool = True) -> tuple[list[str], dict[str, Any]]:
    """The command's own arguments, and TRL's and the launcher's, parsed (a later one wins, as in argparse).
    VramPlanError where one of TRL's is given a value TRL's parser refuses. `trl`: False takes the launcher's options
    only (those before the script of `accelerate launch`)."""
    ours: list[str] = []
    found: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        spelled, has_value, inline = token.partition("=")
        name = _trl_name(spelled, known, trl)
        if name is None:
            ours.append(token)
            i += 1
            continue
        i += 1
        values = [inline] if has_value else []
        launcher = not trl or (is_launch_option(name) and not _is_trls(name))
        while not has_value and not (launcher and name in LAUNCH_FLAGS) and i < len(args) and not _is_option(args[i]):
            values.append(args[i])
            i += 1
        key, value = _launch_parsed(spelled, name, values) if launcher else _parsed(spelled, name, values)
        found.pop(key, None)  # the later spelling's place
        found[key] = value
    return ours, found


def _trl_name(spelled: str, known: set[str], trl: bool = True) -> str | None:
    # TRL's argument or the launcher's option an option names (underscored), or None: the command's own, or no one's
    if not spelled.startswith("--") or spelled in known:
        return None
    name = spelled[2:].replace("-", "_")
    if not trl:
        return name if is_launch_option(name) else None
    if _is_trls(name) or is_launch_option(name):
        return name
    if name.startswith("no_") and name[3:] in BOOLEAN_ARGUMENTS:
        return name
    return None


def _is_trls(name: str) -> bool:
    return name in TRL_ARGUMENTS or name in SHARED_ARGUMENTS


def _is_option(token: str) -> bool:
    # `-1` and `-0.5` are values; `-h` and `--x` are options
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def _launch_parsed(spelled: str, name: str, values: list[str]) -> tuple[str, Any]:
    # accelerate launch's store_true switches take no value, its other options one
    if name in LAUNCH_FLAGS:
        if values:
            raise VramPlanError(f"{spelled} takes no value (accelerate launch's switch)")
        return name, True
    if len(values) != 1:
        raise VramPlanError(f"{spelled} takes one value, as accelerate launch does")
    return name, _scalar(values[0])


def _parsed(spelled: str, name: str, values: list[str]) -> tuple[str, Any]:
    if not _is_trls(name):  # --no_X
        if values:
            raise VramPlanError(f"{spelled} takes no value (TRL's parser sets {name[3:]} to false with it)")
        return name[3:], False
    if name in BOOLEAN_ARGUMENTS:
        if not values:
            return name, True
        if len(values) == 1 and values[0].lower() in TRUTH:
            return name, TRUTH[values[0].lower()]
        raise VramPlanError(f"{spelled} takes yes/no, true/false, t/f, y/n or 1/0, as TRL's parser does "
                            f"(got {' '.join(values)!r})")
    if name in LIST_ARGUMENTS:
        if not values:
            raise VramPlanError(f"{spelled} needs one or more values, as TRL's parser does")
        items = [_scalar(value) for value in values]
        return name, items[0] if len(items) == 1 and name in ONE_IS_THE_NAME else items
    if len(values) != 1:
        raise VramPlanError(f"{spelled} takes one value, as TRL's parser does"
                            + (f" (got {len(values)}: {shlex.join(values)})" if values else ""))
    return name, _scalar(values[0])


def _scalar(text: str) -> Any:
    """A value as TRL's dataclass fields take it: an integer, a number, a mapping in JSON, None, or the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text == "None":
        return None
    if text.startswith("{"):
        from vram_planner.files import load_json  # imported here, not at every command's start

        try:  # refuses nesting deeper than any argument's, which json.loads recurses into
            return load_json(text, "a JSON mapping given as an argument")
        except json.JSONDecodeError as exc:
            raise VramPlanError(f"{text!r} is not a JSON mapping: {exc.msg}") from exc
    return text


def is_command_line(text: str) -> bool:
    """Whether pasted text is a command line (its first option starts a line or follows the command) rather than a
    recipe's YAML."""
    words = text.split()  # (YAML's `---` starts a document, not an option)
    options = [word[2:3].isalpha() and word.startswith("--") for word in words]
    return any(options[:1]) or (len(words) > 1 and not words[0].endswith(":") and any(options))


def command_line_arguments(text: str) -> dict[str, Any]:
    """TRL's arguments of a pasted command (`trl grpo --use_peft ...`, `accelerate launch --num_processes 2 grpo.py
    --bf16 true ...`, continued over lines or not), with the launcher's options (accelerate launch's before the
    script, and those `trl grpo` hands to it): what comes before the first option is the command; VramPlanError where
    an option is neither TRL's nor the launcher's."""
    try:
        words = shlex.split(text.replace("\\\n", " "))
    except ValueError as exc:
        raise VramPlanError(f"the pasted command cannot be read as a shell line: {exc}") from exc
    first_option = next((i for i, word in enumerate(words) if word.startswith("-")), len(words))
    script = None if words[:1] == ["trl"] else next((i for i, word in enumerate(words) if word.endswith(".py")), None)
    launcher: dict[str, Any] = {}
    first = first_option
    if script is not None:
        first = script + 1
        command_end = min(first_option, script)
        launcher = _launcher_options(words[:command_end], words[command_end:script])
    rest, arguments = split_trl_arguments(words[first:], set())
    if words[:1] == ["trl"] or words[:2] == ["accelerate", "launch"]:
        launcher = _with_default_config({**launcher, **arguments}, launcher)
    if rest:
        options = [word for word in rest if word.startswith("--")]
        if "--config" in options:
            raise VramPlanError("the pasted command's --config file is on your machine: paste its YAML here, or "
                                "the command without it")
        raise VramPlanError(f"{options[0] if options else rest[0]} is not one of TRL's arguments")
    if not arguments:
        raise VramPlanError("the pasted command names none of TRL's arguments")
    return {**launcher, **arguments}


def _with_default_config(given: dict[str, Any], launcher: dict[str, Any]) -> dict[str, Any]:
    # accelerate launch reads the config `accelerate config` wrote where none is named (and not for --cpu)
    default = default_accelerate_config()
    if default is None or "config_file" in given or "accelerate_config" in given or given.get("cpu"):
        return launcher
    return {"config_file": str(default), **launcher}


# The interpreters' and launchers' words before a script whose options say nothing of memory
INTERPRETERS = ("python", "python3", "uv", "run")


def _launcher_options(command: list[str], words: list[str]) -> dict[str, Any]:
    """accelerate launch's and torchrun's options before the script; an interpreter's are its own; another
    launcher's (DeepSpeed's) are not read, and said so."""
    if command[:2] == ["accelerate", "launch"]:
        rest, options = split_trl_arguments(words, set(), trl=False)
        unread = [word for word in rest if word.startswith("--")]
        if unread:
            raise VramPlanError(f"{unread[0]} is not one of accelerate launch's options")
        # accelerate's options that TRL's arguments share a name with (gradient_accumulation_steps, debug) are
        # accelerate's here, and the Trainer's own decide
        return {name: value for name, value in options.items() if not _is_trls(name)}
    if not words:
        return {}
    interpreter = command and all(word.rsplit("/", 1)[-1].startswith(INTERPRETERS) for word in command)
    if command[-1:] and command[-1].rsplit("/", 1)[-1] == "torchrun":
        return torchrun_options(words)
    if interpreter and words[:2] == ["-m", "torch.distributed.run"]:
        return torchrun_options(words[2:])
    if interpreter and "-m" not in words:
        return {}
    name = " ".join(command) or words[0]
    raise VramPlanError(f"{name}'s options ({shlex.join(words)}) are not read here: paste the command as accelerate "
                        "launch, torchrun or trl grpo runs it, or plan the processes with --num-gpus (and "
                        "--zero-stage or --fsdp)")


def trl_command_line(edits: dict[str, Any]) -> str:
    """TRL's arguments that set these values, one shell line (the plan's edits to a TRL command)."""
    tokens: list[str] = []
    for key, value in edits.items():
        tokens.append(f"--{key}")
        if isinstance(value, bool):
            tokens.append("true" if value else "false")
        elif isinstance(value, (list, tuple)):
            tokens += [str(item) for item in value]
        elif isinstance(value, dict):
            tokens.append(json.dumps(value))
        else:
            tokens.append(str(value))
    return shlex.join(tokens)
