"""A TRL recipe read as TRL runs it: the YAML that `trl grpo --config`, TRL's example scripts and open-r1 take
(TrlParser's keys: ModelConfig, ScriptArguments, GRPOConfig and the transformers TrainingArguments it extends).

Its names become the request's (model_name_or_path is the model, use_peft turns LoRA on with ModelConfig's defaults,
bf16/fp16 are the mixed precision, generation_batch_size is steps_per_generation, ...); the arguments that move no GPU
memory are left out and counted (vram_planner.trl_names); one that moves memory in a way the plan does not count is
refused unless it has the value the plan assumes; the keys no TRL config has are the training script's own (open-r1's
system_prompt, dataset_configs), left out and named. Pure Python: the model's config is read only where the recipe leaves
TRL to take something from it (dtype auto, PEFT's default LoRA targets).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vram_planner.errors import ConfigError, closest_names
from vram_planner.trl_names import (LAST_RELEASE_WITH, MEMORY_NEUTRAL_ARGUMENTS, NOTED_ARGUMENTS,
                                    RUN_CARRIED_ARGUMENTS, SHARED_ARGUMENTS, TRL_ARGUMENTS, TRL_NAMES,
                                    UNPLANNED_ARGUMENTS, same_value)

if TYPE_CHECKING:
    from vram_planner.launcher import Launch

# Every TrlParser recipe names its model so; a settings file of ours names `model`
RECIPE_KEY = "model_name_or_path"
# ModelConfig's LoRA defaults (TRL 0.14-1.16), which use_peft takes where the recipe sets none
MODEL_CONFIG_LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05}
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
# PEFT's LoRA targets for a model_type when LoraConfig names none (peft.utils.constants
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); a model_type it lacks makes LoraConfig raise
PEFT_DEFAULT_TARGETS = {
    "llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"], "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"],
    "gemma3_text": ["q_proj", "v_proj"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
}
DTYPES = ("float32", "bfloat16", "float16")
# how alike a script's key and a planned name must be to be shown as a possible typo (difflib's ratio): a letter or
# two apart, not open-r1's dataset_configs beside fsdp_config
TYPO_CUTOFF = 0.9
# the keys of gradient_checkpointing_kwargs that change no memory
NEUTRAL_CHECKPOINTING_KWARGS = ("preserve_rng_state", "determinism_check", "debug")


@dataclass(frozen=True)
class Recipe:
    """What a recipe asks for, as the request's fields, and what of it the plan leaves out."""

    settings: dict[str, Any]
    values: Mapping[str, Any]  # the recipe's keys (underscored) and values, the model given beside it in
    left_out: tuple[str, ...]  # TRL's arguments that move no GPU memory here (or have the value planned)
    script_keys: tuple[str, ...]  # keys no TRL config has: the training script's own
    not_planned: tuple[str, ...] = ()  # what the recipe runs beside the planned step (evaluation), as `key value`
    older_release: str = ""  # where the recipe names fields of releases before the one planned: which, and until when
    command_line: bool = False  # TRL's arguments given on the command line, alone or over a recipe file's
    launch_notes: tuple[str, ...] = ()  # how the launcher's options were read (vram_planner.launcher)

    @property
    def given(self) -> frozenset[str]:
        return frozenset(self.values)

    @property
    def unused_lora(self) -> tuple[str, ...]:
        """LoRA's keys without use_peft, which TRL leaves unused."""
        if self.values.get("use_peft"):
            return ()
        return tuple(field for field in LORA_FIELDS if self.values.get(field) is not None)

    @property
    def run_arguments(self) -> dict[str, Any]:
        """How the recipe trains, which `vram-plan run` carries into its GRPOConfig (RUN_CARRIED_ARGUMENTS)."""
        return {key: value for key, value in self.values.items() if key in RUN_CARRIED_ARGUMENTS}

    def summary(self) -> str:
        """One line on what was read and left out, for the person who gave the recipe."""
        count = len(self.left_out)
        read = "Read as TRL's arguments" if self.command_line else "Read as a TRL recipe"
        parts = [f"{read}: {count} of {'them' if self.command_line else 'its keys'} "
                 f"{'moves' if count == 1 else 'move'} no GPU memory here and {'is' if count == 1 else 'are'} left "
                 "out" if count else read]
        if self.not_planned:
            parts.append(f"evaluation ({', '.join(self.not_planned)}) is not planned: it runs between optimizer "
                         "steps, without gradients, from per_device_eval_batch_size")
        if self.unused_lora:
            parts.append(f"{', '.join(self.unused_lora)} {'is' if len(self.unused_lora) == 1 else 'are'} unused "
                         "without use_peft: true, so TRL trains the whole model, as planned")
        if self.older_release:
            parts.append(self.older_release)
        parts += self.launch_notes
        if self.script_keys:
            named = [key + (f" (not {near[0]}?)" if (near := _planned_near(key, self.given)) else "")
                     for key in self.script_keys]
            parts.append(f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} the training script's own, not "
                         "planned")
        return "; ".join(parts)


def is_recipe(values: Mapping[str, Any]) -> bool:
    """Whether a settings mapping names any of TRL's arguments that are not also ours (a recipe may leave the model
    to the command line, as `trl grpo --model_name_or_path M --config recipe.yaml` does)."""
    from vram_planner.request import request_fields

    ours = set(request_fields())
    return any(key not in ours and key in TRL_ARGUMENTS for key in (str(k).replace("-", "_") for k in values))


def read_recipe(values: Mapping[str, Any], beside: Mapping[str, Any] | None = None,
                command_line: bool = False) -> Recipe:
    """The request's fields a recipe spells; ConfigError with every problem at once. `beside`: the request's fields
    given with it (the command line's flags, api.recipe's keyword arguments), which win over the recipe's, so its
    model, release, micro-batch and GPUs are those the recipe's names are read for. `command_line`: TRL's arguments
    came on the command line (the note says so)."""
    from vram_planner.request import request_fields

    given = {str(key).replace("-", "_"): value for key, value in values.items()}
    beside = {key: value for key, value in (beside or {}).items() if value is not None}
    if "model" in beside:
        given[RECIPE_KEY] = beside["model"]
    fields = set(request_fields())
    settings: dict[str, Any] = {}
    left_out: list[str] = []
    script_keys: list[str] = []
    not_planned: list[str] = []
    problems: list[str] = []
    launch_options: dict[str, Any] = {}
    for key, value in given.items():
        if key in _TRANSLATED:
            continue
        if is_launch_key(key):  # trl grpo hands the keys its parser does not know to accelerate launch
            launch_options[key] = value
            continue
        if key == "deepspeed":
            if value not in (None, ""):
                launch_options["deepspeed_config_file"] = value
            else:
                left_out.append(key)
            continue
        if key == "fsdp" and not isinstance(value, bool):  # TrainingArguments': "full_shard auto_wrap", a list
            if value:
                problems.append(f"fsdp {value!r}: the Trainer's FSDP options are not read; plan FSDP2 as TRL launches "
                                "it, --accelerate_config fsdp2 --num_processes N (or fsdp: true and num_gpus)")
            continue
        if key in fields:
            if key not in LORA_FIELDS:
                settings[key] = value
        elif key in MEMORY_NEUTRAL_ARGUMENTS:
            left_out.append(key)
        elif key in UNPLANNED_ARGUMENTS:
            accepted, effect = UNPLANNED_ARGUMENTS[key]
            if same_value(value, accepted):
                left_out.append(key)
            elif key in NOTED_ARGUMENTS:
                not_planned.append(f"{key} {value!r}")
            else:
                problems.append(f"{key} {value!r} is not planned ({effect}); the plan assumes {accepted[0]!r}")
        else:
            script_keys.append(key)
    if given.get(RECIPE_KEY) is not None:
        settings["model"] = given[RECIPE_KEY]
    problems += _translated(given, settings, left_out, beside)
    launch = _launch(launch_options, given, {**settings, **beside})
    settings.update(launch.settings)
    problems += launch.problems
    if problems:
        raise ConfigError(problems)
    return Recipe(settings, given, tuple(left_out), tuple(script_keys), tuple(not_planned),
                  _older_release(given, {**settings, **beside}.get("trl_version")), command_line,
                  tuple(launch.notes))


def is_launch_key(key: str) -> bool:
    """Whether a recipe's key is the launcher's (accelerate launch's, TRL's accelerate_config) rather than TRL's."""
    from vram_planner.launcher import is_launch_option

    return is_launch_option(key) and key not in TRL_ARGUMENTS and key not in SHARED_ARGUMENTS


def _launch(options: dict[str, Any], given: dict[str, Any], request: dict[str, Any]) -> Launch:
    """How the launcher's options read (vram_planner.launcher.Launch), beside the request's fields read so far."""
    from vram_planner.launcher import Launch, launch_settings
    from vram_planner.model.trl_releases import trl_release

    if not options:
        return Launch()
    try:
        release_default = trl_release(request.get("trl_version")).default_mixed_precision
    except Exception:  # an unknown release is the request's to refuse, with its own words
        release_default = "bf16"
    # TrainingArguments takes accelerate's mixed precision where neither bf16 nor fp16 is true; TRL from 0.19 on
    # makes bf16 true where neither is given (its release's default_mixed_precision)
    bf16, fp16 = given.get("bf16"), given.get("fp16")
    if fp16 is True:
        precision = "fp16"
    elif bf16 is True or (bf16 is None and fp16 is None and release_default != "no"):
        precision = "bf16"
    else:
        precision = None
    return launch_settings(options, precision, gpus_given=request.get("num_gpus") is not None)


# The keys read below rather than copied: TRL's names of a setting, and two fields of ours that those names set too
_TRANSLATED = frozenset(TRL_NAMES) | {"dtype", "use_reentrant"}


def _translated(given: dict[str, Any], settings: dict[str, Any], left_out: list[str],
                beside: dict[str, Any]) -> list[str]:
    """TRL's names as the request's fields, in place (`beside`: the fields given with the recipe); the problems
    found."""
    problems: list[str] = []
    _take(given, settings, "use_reentrant", "use_reentrant")
    _take(given, settings, "vllm_max_model_len", "vllm_max_model_length")
    _take(given, settings, "per_gpu_train_batch_size", "per_device_train_batch_size")  # transformers 4: it wins
    _take(given, settings, "use_bnb_nested_quant", "bnb_4bit_use_double_quant")
    if given.get("activation_checkpointing") is not None:
        settings["gradient_checkpointing"] = given["activation_checkpointing"]
    if given.get("adafactor") is True:  # transformers 4 replaced optim with Adafactor
        settings["optim"] = "adafactor"
    elif "adafactor" in given:
        left_out.append("adafactor")
    for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        problems += _checkpointing_kwargs(name, given.get(name), settings)
    problems += _precision(given, settings)
    problems += _model_init(given, settings)
    if settings.get("dtype") == "auto" and not problems and "model" in settings:
        problems += _checkpoint_dtype(settings)
    problems += _generation_batch(given, settings, {**settings, **beside})
    problems += _lora(given, settings)
    return problems


def _older_release(given: dict[str, Any], trl_version: str | None) -> str:
    """Which of the recipe's fields a release before the planned one last had, for the note."""
    from vram_planner.model.trl_releases import trl_release, version_tuple

    older = sorted((key for key in given if key in LAST_RELEASE_WITH),
                   key=lambda key: version_tuple(LAST_RELEASE_WITH[key]))
    try:
        planned = trl_release(trl_version).version
    except Exception:  # an unknown release is the request's to refuse, with its own words
        return ""
    older = [key for key in older if version_tuple(LAST_RELEASE_WITH[key]) < version_tuple(planned)]
    if not older:
        return ""
    named = ", ".join(f"{key} (TRL up to {LAST_RELEASE_WITH[key]})" for key in older)
    return (f"{named} {'is a field' if len(older) == 1 else 'are fields'} of an older release than the TRL "
            f"{planned} planned: --trl-version {LAST_RELEASE_WITH[older[0]]} plans the recipe as written")


def _take(given: dict[str, Any], settings: dict[str, Any], key: str, field: str) -> None:
    if given.get(key) is not None:
        settings[field] = given[key]


def _checkpointing_kwargs(name: str, kwargs: Any, settings: dict[str, Any]) -> list[str]:
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return [f"{name} should be a mapping such as {{use_reentrant: false}}"]
    problems = []
    for key, value in kwargs.items():
        if key == "use_reentrant" and isinstance(value, bool):
            settings["use_reentrant"] = value
        elif key == "every_n_layers" and value == 1:
            continue
        elif key not in NEUTRAL_CHECKPOINTING_KWARGS:
            problems.append(f"{name} {key}: {value!r} is not planned (the plan checkpoints every layer, use_reentrant "
                            "as given or as the release runs it)")
    return problems


def _precision(given: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """bf16/fp16 as the mixed precision, ModelConfig's (torch_)dtype as the weights' (auto: the checkpoint's)."""
    bf16, fp16 = given.get("bf16"), given.get("fp16")
    if bf16 is True and fp16 is True:
        return ["bf16 and fp16 cannot both be true (TrainingArguments refuses it)"]
    if fp16 is True:
        settings["mixed_precision"] = "fp16"
    elif bf16 is True:
        settings["mixed_precision"] = "bf16"
    elif bf16 is False:
        settings["mixed_precision"] = "no"
    dtypes = {given[key] for key in ("dtype", "torch_dtype") if given.get(key) is not None}
    if len(dtypes) > 1:
        return [f"dtype and torch_dtype differ ({' and '.join(sorted(map(str, dtypes)))}): give one"]
    if dtypes:
        settings["dtype"] = dtypes.pop()
    return []


def _model_init(given: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """GRPOConfig's model_init_kwargs: TRL's script lays them over ModelConfig's dtype and attention."""
    kwargs = given.get("model_init_kwargs")
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return ["model_init_kwargs should be a mapping of from_pretrained's arguments"]
    problems = []
    for key, value in kwargs.items():
        if key in ("dtype", "torch_dtype") and value is not None:
            settings["dtype"] = value
        elif key == "attn_implementation" and value is not None:
            settings["attn_implementation"] = value
        elif key == "use_kernels" and value is not None:
            settings["use_kernels"] = value
        elif key not in ("revision", "trust_remote_code", "use_cache") or (key == "use_cache" and value):
            problems.append(f"model_init_kwargs {key}: {value!r} is not planned")
    return problems


def _checkpoint_dtype(settings: dict[str, Any]) -> list[str]:
    """dtype auto: the dtype the checkpoint's config.json names (float32 where it names none)."""
    config = _model_config(settings["model"])
    dtype = config.get("dtype") or config.get("torch_dtype")
    settings["dtype"] = dtype if dtype in DTYPES else "float32"
    return [] if dtype in DTYPES or dtype is None else [f"dtype auto: the checkpoint's {dtype} is not planned"]


def _generation_batch(given: dict[str, Any], settings: dict[str, Any], context: dict[str, Any]) -> list[str]:
    """generation_batch_size: the prompts-times-generations of one generation, over the global batch."""
    size = given.get("generation_batch_size")
    if size is None:
        return []
    if given.get("steps_per_generation") is not None:
        return ["generation_batch_size and steps_per_generation cannot both be set (GRPOConfig refuses it)"]
    from vram_planner.model.trl_releases import trl_release

    batch = context.get("per_device_train_batch_size")
    if batch is None:
        try:
            batch = trl_release(context.get("trl_version")).default_per_device_train_batch_size
        except Exception:  # an unknown release is the request's to refuse, with its own words
            return []
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        return []  # the request refuses the micro-batch itself
    gpus = context.get("num_gpus")
    global_batch = batch * (gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0 else 1)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % global_batch:
        return [f"generation_batch_size {size!r} must be a multiple of the global batch "
                f"(per_device_train_batch_size x GPUs = {global_batch})"]
    settings["steps_per_generation"] = size // global_batch
    return []


def _lora(given: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """LoRA only with use_peft, as TRL's get_peft_config: ModelConfig's defaults, PEFT's targets for the model."""
    lora = {field: given[field] for field in LORA_FIELDS if given.get(field) is not None}
    if not given.get("use_peft"):  # TRL builds no LoraConfig: the LoRA fields are unused (Recipe.unused_lora)
        return []
    settings.update({**MODEL_CONFIG_LORA, **lora})
    if given.get("disable_dropout"):  # every nn.Dropout's p to 0, PEFT's LoRA dropout too
        settings["lora_dropout"] = 0.0
    if "lora_target_modules" in lora or "model" not in settings:  # no model: the command misses it
        return []
    model_type = _model_config(settings["model"]).get("model_type")
    if model_type not in PEFT_DEFAULT_TARGETS:
        return [f"use_peft without lora_target_modules: PEFT has no default LoRA targets for model_type "
                f"{model_type!r} (LoraConfig raises); name them, e.g. lora_target_modules: all-linear"]
    settings["lora_target_modules"] = PEFT_DEFAULT_TARGETS[model_type]
    return []


def _model_config(model: Any) -> dict[str, Any]:
    from vram_planner.profiles import model_config

    if isinstance(model, Mapping):
        return dict(model)
    return model_config(model)[0]


def _planned_near(key: str, given: frozenset[str]) -> list[str]:
    """A planned name the recipe does not set that a script's key is close to: were it a typo, the plan would take
    that setting's default."""
    from vram_planner.request import knob_fields

    names = [name for name in (*knob_fields(), *TRL_NAMES, *UNPLANNED_ARGUMENTS) if name not in given]
    return closest_names(key, names, limit=1, cutoff=TYPO_CUTOFF)


__all__ = ["Recipe", "is_recipe", "read_recipe"]


def recipe_edits(recipe: Recipe, requested: Any, chosen: Any) -> dict[str, Any]:
    """What to set in the recipe for the plan's choice, in the recipe's own names: the arguments TRL would be given
    for the chosen config (vram_planner.model.grpo_config) that differ from those of the config the recipe asked for.
    `requested` and `chosen` are TrainingConfigs."""
    before, after = _recipe_arguments(recipe, requested), _recipe_arguments(recipe, chosen)
    return {key: value for key, value in after.items() if before.get(key, _UNSET) != value}


_UNSET = object()


def _recipe_arguments(recipe: Recipe, train: Any) -> dict[str, Any]:
    """The recipe's arguments that give TRL this config (GRPOConfig's, then ModelConfig's for the model's loading,
    LoRA and 4-bit weights)."""
    from vram_planner.model.grpo_config import (CHECKPOINTING_SPELLINGS, grpo_config_kwargs, lora_config_kwargs,
                                                quantization_config_kwargs)

    arguments = grpo_config_kwargs(train)
    # the recipe's spelling of gradient checkpointing (transformers 5.23 renamed it; both names work until 6.0)
    spelled = [name for name in arguments if name in CHECKPOINTING_SPELLINGS]
    if any(CHECKPOINTING_SPELLINGS[name] in recipe.given for name in spelled) and not recipe.given & set(spelled):
        arguments.update({CHECKPOINTING_SPELLINGS[name]: arguments.pop(name) for name in spelled})
    loading = arguments.pop("model_init_kwargs", {})
    dtype_key = "torch_dtype" if "torch_dtype" in recipe.given or "torch_dtype" in loading else "dtype"
    arguments[dtype_key] = loading.get("dtype", loading.get("torch_dtype"))
    arguments["attn_implementation"] = loading.get("attn_implementation", "sdpa")
    if "generation_batch_size" in recipe.given and "steps_per_generation" in arguments:
        arguments["generation_batch_size"] = (arguments.pop("steps_per_generation") * train.per_device_train_batch_size
                                              * train.num_gpus)
    if "vllm_max_model_len" in recipe.given and "vllm_max_model_length" in arguments:
        arguments["vllm_max_model_len"] = arguments.pop("vllm_max_model_length")
    lora = lora_config_kwargs(train)
    if lora is not None:
        arguments.update(use_peft=True, lora_r=lora["r"], lora_alpha=lora["lora_alpha"],
                         lora_dropout=lora["lora_dropout"], lora_target_modules=lora["target_modules"])
    quantization = quantization_config_kwargs(train)
    if quantization is not None:
        arguments.update(load_in_4bit=True, bnb_4bit_quant_type=quantization["bnb_4bit_quant_type"],
                         use_bnb_nested_quant=quantization["bnb_4bit_use_double_quant"])
    return arguments
