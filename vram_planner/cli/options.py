"""What the commands share: the knobs spelled like GRPOConfig fields, the context options, the exit codes, and
reading the model, the GPU and the knobs from the flags over a --config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from vram_planner.errors import VramPlanError

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_ERROR = 0, 1, 2
PATH = click.Path(path_type=Path, dir_okay=False)

class GpuCount(click.ParamType):
    """--num-gpus: a count, or auto (the fewest that fit: vram_planner/model/fewest_gpus.py)."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or str(value).strip().lower() == "auto":
            return value if isinstance(value, int) else "auto"
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number of GPUs nor auto", param, ctx)


GPU_COUNT = GpuCount()
# Knobs are spelled like GRPOConfig fields; unset ones take the TRL release's defaults (None = not given).
KNOBS = [
    click.option("--per-device-train-batch-size", type=int),
    click.option("--gradient-accumulation-steps", type=int),
    click.option("--steps-per-generation", type=int),
    click.option("--num-generations", type=int),
    click.option("--max-prompt-length", type=int, help="Longest prompt of your dataset, in tokens (default 256)."),
    click.option("--max-completion-length", type=int),
    click.option("--beta", type=float),
    click.option("--num-iterations", type=int),
    click.option("--temperature", type=float,
                 help="generate()'s sampling; without vLLM each filter holds logits-sized tensors at every step."),
    click.option("--top-p", type=float),
    click.option("--top-k", type=int, help="0: no top-k filter."),
    click.option("--min-p", type=float, help="Unset: no min-p filter (0 still runs it)."),
    click.option("--repetition-penalty", type=float),
    click.option("--optim", help="transformers optimizer name, e.g. adamw_torch_fused, adamw_8bit."),
    click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None),
    click.option("--use-reentrant/--no-use-reentrant", default=None,
                 help="use_reentrant of gradient_checkpointing_kwargs (activation_checkpointing_kwargs from "
                      "transformers 5.23; default: as the TRL release runs it)."),
    click.option("--dtype", help="Weights' dtype: float32 (TRL's default), bfloat16, float16."),
    click.option("--mixed-precision", help="bf16 (default), fp16 or no."),
    click.option("--attn-implementation", help="sdpa (default), eager or flash_attention_2."),
    click.option("--use-liger-kernel/--no-use-liger-kernel", default=None),
    click.option("--use-kernels/--no-use-kernels", default=None,
                 help="from_pretrained's use_kernels: the Hub's kernels (transformers 5.25+: on unless turned off)."),
    click.option("--cast-lm-head-to-fp32/--no-cast-lm-head-to-fp32", default=None,
                 help="The LM head of the policy and reference model in float32 (ScaleRL; TRL 0.25+)."),
    click.option("--use-vllm/--no-use-vllm", default=None),
    click.option("--vllm-mode", help="colocate (default) or server."),
    click.option("--vllm-gpu-memory-utilization", type=float),
    click.option("--vllm-enable-sleep-mode/--no-vllm-enable-sleep-mode", default=None),
    click.option("--vllm-max-model-length", type=int, help="vLLM's context (default: the model's, TRL 0.26+)."),
    click.option("--vllm-tensor-parallel-size", type=int),
    click.option("--vllm-server-gpu", help="Server mode: the card trl vllm-serve runs on (planned too)."),
    click.option("--lora-r", type=int),
    click.option("--lora-alpha", type=int),
    click.option("--lora-dropout", type=float),
    click.option("--lora-target-modules", help="Comma-separated module names, or all-linear."),
    click.option("--load-in-4bit/--no-load-in-4bit", default=None),
    click.option("--bnb-4bit-quant-type", help="nf4 or fp4."),
    click.option("--bnb-4bit-use-double-quant/--no-bnb-4bit-use-double-quant", default=None),
    click.option("--num-gpus", type=GPU_COUNT,
                 help="GPUs of the card, or auto: the fewest that fit, with the strategy (up to one node of 8)."),
    click.option("--zero-stage", type=int),
    click.option("--fsdp/--no-fsdp", default=None),
    click.option("--ds3-gather-for-generation/--no-ds3-gather-for-generation", default=None,
                 help="ZeRO-3: gather the whole model to generate (TRL's default), or layer by layer."),
    click.option("--reduce-bucket-size", metavar="ELEMENTS",
                 help="ZeRO: DeepSpeed's gradient reduction bucket, like 2e8, or auto (hidden size squared, as "
                      "transformers fills it; default 5e8)."),
    click.option("--overlap-comm/--no-overlap-comm", default=None,
                 help="ZeRO-2/3: reduce gradients beside the backward, in two buckets below stage 3 (DeepSpeed's "
                      "default: on at stage 3 only)."),
    click.option("--stage3-prefetch-bucket-size", metavar="ELEMENTS",
                 help="ZeRO-3: elements a prefetch round gathers ahead, like 5e7 (DeepSpeed's default), or auto "
                      "(0.9 x hidden size squared, as transformers fills it)."),
    click.option("--stage3-param-persistence-threshold", metavar="ELEMENTS",
                 help="ZeRO-3: parameters of at most this many elements stay gathered, like 1e5 (DeepSpeed's "
                      "default), or auto (10 x hidden size)."),
    click.option("--offload-optimizer", help="cpu: ZeRO-Offload's optimizer on the host (--zero-stage 2 or 3)."),
    click.option("--offload-param", help="cpu: ZeRO-3's parameters on the host, or FSDP2's CPU offload (--fsdp)."),
    click.option("--host-memory", metavar="SIZE", help="RAM of one node for offloaded states, like 512GiB "
                                                      "(default: this machine's)."),
    click.option("--transformers-version", metavar="VERSION",
                 help="Plan for this transformers release (default: the installed one, if of the TRL release's time)."),
    click.option("--allocator-conf", metavar="TEXT",
                 help="PYTORCH_CUDA_ALLOC_CONF of the run, e.g. expandable_segments:True (default: that environment "
                      "variable)."),
]
# What a config is judged against besides the card (`gpus --model` judges it on every card).
MODEL_CONTEXT = [
    click.option("--model", help="Catalog name, config.json, model folder or hub id."),
    click.option("--config", "config_file", type=PATH,
                 help="YAML/JSON file with the same keys as the flags, or a TRL recipe (trl grpo --config's YAML)."),
    click.option("--trl-version", help="Plan for this TRL release (default: the installed one)."),
    click.option("--calibration", type=PATH, help="Calibration profile to use."),
    click.option("--safety-margin", type=click.FloatRange(0, 0.5), default=0.05, show_default=True,
                 help="Share of the card kept free."),
]
CONTEXT = [click.option("--gpu", help="Catalog name, 'auto', or a size like 24GiB."), *MODEL_CONTEXT]
# What plan/check/trace report besides the exit code; a run's output is its folder and log instead.
REPORT = [
    click.option("--json", "json_output", is_flag=True, help="Print one JSON document."),
    click.option("--plot", type=PATH, help="Write stacked bars per phase to this PNG."),
]

# `plan --maximize FIELD` and `gpus --model M --maximize FIELD`: the largest value of one knob that fits.
MAXIMIZE = [
    click.option("--maximize", metavar="FIELD",
                 help="The largest value that fits of max_completion_length, max_prompt_length, num_generations, "
                      "per_device_train_batch_size or lora_r, every other knob as given."),
    click.option("--allow-savers", is_flag=True,
                 help="With --maximize: let the plan's savers (smaller micro-batches, checkpointing, 8-bit AdamW, "
                      "bf16 weights, LoRA, QLoRA) make room."),
]

# `check --exact` and `plan --exact`: the verdict from the traced step's need (the train extra).
EXACT = click.option("--exact", is_flag=True,
                     help="Trace the step and judge by the least card it runs on, found by replaying it through "
                          "the caching allocator model (needs the train extra; seconds to a minute).")

# `check --exact --keep-copy`: the exact engine's copy of the step kept for later checks (step_copy)
KEEP_COPY = click.option("--keep-copy", is_flag=True,
                         help="With --exact: also make the step's copy (seven traces of a shallow copy of the model, "
                              "seconds to a minute) and keep it, so that check of this model and these knobs at other "
                              "lengths answers from it near the boundary, without torch.")

NOT_KNOBS = ("gpu", "model", "config_file", "json_output", "plot", "trl_version", "calibration", "safety_margin",
             "maximize", "allow_savers", "exact", "keep_copy", "optimize", "reward_seconds", "dataset_prompts",
             "recipe", "trl_arguments")


def settings_from(command: str, options: dict[str, Any],
                  gpu_required: bool = True) -> tuple[str, str | None, str | None, dict]:
    """The model, the GPU, the TRL release and the knobs from the flags, over the --config file's values."""
    from vram_planner.cli.settings_file import read_settings_file

    settings, recipe = read_settings_file(options["config_file"], options, options.get("trl_arguments"))
    if recipe is not None:  # the report's to speak of (vram_planner/cli/plan.py _emit), where the command answers
        options["recipe"] = recipe
    for name in ("gpu", "model"):  # an empty value is a mistake, not "not given"
        if (options[name] is not None and not options[name].strip()) or settings.get(name) == "":
            raise VramPlanError(f"--{name} is empty; give a catalog name (vram-plan {name}s) or "
                                + ("a size such as 24GiB" if name == "gpu" else "a config.json, folder or hub id"))
    gpu = options["gpu"] or settings.get("gpu")
    model = options["model"] or settings.get("model")
    missing = [f"--{name}" for name, value in (("gpu", gpu or not gpu_required), ("model", model)) if not value]
    if missing:
        raise VramPlanError(f"{command} needs {' and '.join(missing)} (e.g. vram-plan {command} --gpu rtx3080-mobile "
                            "--model Llama-3.2-1B)")
    trl_version = options["trl_version"] if options["trl_version"] is not None else settings.get("trl_version")
    knobs = {k: v for k, v in settings.items() if k not in ("gpu", "model", "trl_version")}
    knobs.update({k: v for k, v in options.items() if k not in NOT_KNOBS and v is not None})
    return model, gpu, trl_version, knobs


def request_from(command: str, options: dict[str, Any], gpu_required: bool = True):
    """The request the flags spell, over the --config file's values (vram_planner.request.Request)."""
    from vram_planner.request import Request

    model, gpu, trl_version, knobs = settings_from(command, options, gpu_required)
    return Request.of({**knobs, "model": model, "gpu": gpu, "trl_version": trl_version,
                       "calibration": options["calibration"], "safety_margin": options["safety_margin"]})


def resolve(command: str, options: dict[str, Any]):
    """The context and training config from the flags, over the --config file's values."""
    context, train, _ = resolve_gpu_count(command, options)
    return context, train


def resolve_gpu_count(command: str, options: dict[str, Any]):
    """As `resolve`, and with --num-gpus auto the search that chose the count and strategy (else None)."""
    from vram_planner import api

    return api.resolve_gpu_count(request_from(command, options))
