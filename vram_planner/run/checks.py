"""Everything a run depends on, checked before anything is written or the smoke step starts: optional
packages, the output folder, a model folder's weights, the dataset's prompts and columns, the chat template,
rewards on a sample batch; bad input leaves nothing behind."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError, first_line
from vram_planner.allocator import parse_allocator_conf
from vram_planner.extras import require_bitsandbytes, require_kernels, require_vllm
from vram_planner.files import check_writable
from vram_planner.model.spec import TrainingConfig
from vram_planner.run.memory_history import OOM_SNAPSHOT_NAME
from vram_planner.run.progress import LOG_NAME
from vram_planner.run.record import RECORD_NAME
from vram_planner.run.rewards import check_rewards, load_reward, sample_batch
from vram_planner.run.setup import RunSetup
from vram_planner.run.several import CONFIG_NAME, launched_worker, missing_launcher

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def check_model_folder(model_id: str) -> None:
    """A local model folder must hold a config and weights; hub ids are left to transformers."""
    path = Path(model_id).expanduser()
    if not path.exists():
        return
    if not path.is_dir() or not (path / "config.json").is_file():
        raise VramPlanError(f"{model_id} is not a model folder with a config.json")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise VramPlanError(f"{model_id} has a config.json but no weights (*.safetensors or *.bin): training "
                            "needs the model's weights, not only its configuration")


def check_hub_model(setup: RunSetup) -> None:
    """A hub model needs the hub, or its files in the local cache: asked once, before anything else, instead of
    half a minute of transformers' retries after the smoke step has begun. Offline with the model cached, the run
    reads the cache only."""
    if Path(setup.model_id).expanduser().exists():
        return
    from vram_planner.hub import hub_unreachable_reason

    reason = hub_unreachable_reason()
    if reason is None:
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(setup.model_id, "config.json"), str):
        constants.HF_HUB_OFFLINE = True  # what transformers asks before each download: the cache, no retries
        os.environ["HF_HUB_OFFLINE"] = "1"  # and so do the processes accelerate launches
        setup.notes.append(f"the hub cannot be reached ({reason}): {setup.model_id} is read from the local cache")
        return
    refuse(setup, f"{setup.model_id} is a hub model, and the hub cannot be reached ({reason}) nor is the model in "
                  "the local cache: check the network, or pass a local model folder")


def refuse(setup: RunSetup, problem: str) -> None:
    """Stop the run for `problem`; a dry run, which only prints the config, notes it instead."""
    if not setup.dry_run:
        raise VramPlanError(problem)
    setup.notes.append(problem)


def prepared_dataset(setup: RunSetup) -> Any:
    """The dataset with its prompts and columns checked, the chat template tried on chat prompts, and each reward
    tried on a sample batch."""
    from vram_planner.run.train_data import check_prompts, load_prompts, require_columns

    dataset = load_prompts(setup.dataset)
    require_columns(dataset, {"prompt"}, "GRPOTrainer reads the prompts from it")
    if "correctness" in setup.rewards:
        require_columns(dataset, {"answer"}, "the correctness reward compares with it")
    chat = check_prompts(dataset)
    processor = check_chat_template(setup.model_id, dataset) if chat else None
    if not setup.train.release.truncates_prompts:
        try:
            processor = processor or load_processor(setup.model_id, "the dataset's prompts are counted in its tokens")
        except VramPlanError as problem:
            if not setup.dry_run:
                raise
            setup.notes.append(f"prompt lengths not checked: {problem}")
        else:
            check_prompt_lengths(setup, dataset, processor, chat)
    check_rewards({name: load_reward(name) for name in setup.rewards}, sample_batch(dataset))
    return dataset


# What a model folder's processor is saved as, beside its tokenizer (transformers' image and video processors, and
# the processor that holds them)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def tokenizer_only(model_id: str) -> bool:
    """A local model folder with a tokenizer and no processor: GRPOTrainer's AutoProcessor would ask a multimodal
    config's folder for the image processor it lacks, so the run trains its text with the tokenizer (for a text
    model the tokenizer is what AutoProcessor gives anyway)."""
    path = Path(model_id).expanduser()
    return path.is_dir() and not any((path / name).is_file() for name in PROCESSOR_FILES)


def load_processor(model_id: str, why: str) -> Any:
    """The tokenizer (or processor) as the run gives it to GRPOTrainer; offline, from the cache only, without
    retries."""
    from transformers import AutoProcessor, AutoTokenizer

    from vram_planner.hub import hub_unreachable_reason, quiet_hub_logs

    offline = None if Path(model_id).expanduser().exists() else hub_unreachable_reason()
    kind = AutoTokenizer if tokenizer_only(model_id) else AutoProcessor
    try:
        with quiet_hub_logs():  # offline: the cache only, without half a minute of retries
            return kind.from_pretrained(model_id, truncation_side="left", padding_side="left",
                                        local_files_only=offline is not None)
    except Exception as exc:
        raise VramPlanError(f"cannot load the tokenizer of {model_id} ({offline or first_line(exc, limit=200)}); "
                            f"{why}") from exc


def check_prompt_lengths(setup: RunSetup, dataset: Any, processor: Any, chat: bool) -> None:
    """The plan counts prompts of max_prompt_length tokens, and the TRL release planned for does not truncate them:
    a longer prompt in the dataset would make every phase larger than planned, so it is refused with both numbers."""
    tokenizer = getattr(processor, "tokenizer", processor)
    longest, row = 0, 0
    for index, prompt in enumerate(dataset["prompt"], start=1):
        if chat:
            tokens = len(processor.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        else:
            tokens = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if tokens > longest:
            longest, row = tokens, index
    planned = setup.train.max_prompt_length
    if longest > planned:
        raise VramPlanError(f"the dataset's longest prompt is {longest} tokens (row {row}), longer than the {planned} "
                            f"the plan counts, and TRL {setup.train.release.version} does not truncate prompts: pass "
                            f"--max-prompt-length {longest} so the plan counts it, or shorten the prompts")


def check_chat_template(model_id: str, dataset: Any) -> Any:
    """Chat prompts are rendered with the tokenizer's chat template: load the tokenizer as GRPOTrainer does and render
    the first prompts with it. Returns the processor."""
    processor = load_processor(model_id, "the dataset's prompts are chat messages, which need its chat template")
    if not getattr(processor, "chat_template", None):
        raise VramPlanError(f"the dataset's prompts are chat messages, but the tokenizer of {model_id} has no chat "
                            "template to render them: use a model with one (an instruct or chat model) or plain-text "
                            "prompts")
    for row, prompt in enumerate(dataset.select(range(min(len(dataset), 8)))["prompt"], start=1):
        try:
            processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise VramPlanError(f"the chat template of {model_id} cannot render row {row} of the dataset: "
                                f"{first_line(exc, limit=200)}") from exc
    return processor


def check_dependencies(train: TrainingConfig, dry_run: bool = False, notes: list[str] | None = None) -> None:
    """The optional packages the plan's config needs (bitsandbytes for 8-bit optimizers and 4-bit weights,
    accelerate for several GPUs, DeepSpeed for ZeRO, kernels for use_kernels), and a torch that reads its allocator
    settings. A dry run notes the launcher's packages it lacks and the settings torch would refuse instead: it only
    prints the config and the launch line."""
    problem = missing_launcher(train)
    if problem is not None:
        if not dry_run:
            raise VramPlanError(problem)
        if notes is not None:
            notes.append(problem)
    if train.optim.needs_bitsandbytes:
        require_bitsandbytes(f"--optim {train.optim.value}")
    if train.load_in_4bit:
        require_bitsandbytes("--load-in-4bit")
    if train.use_vllm:
        require_vllm("--use-vllm")
    if train.use_kernels:
        require_kernels("--use-kernels")
    problem = torch_refusal(train.allocator_conf, "--allocator-conf")
    if problem is not None:
        if not dry_run:
            raise VramPlanError(problem)
        if notes is not None:
            notes.append(problem)


def torch_refusal(allocator_conf: str, why: str) -> str | None:
    """Why the installed torch would refuse `allocator_conf`: torch 2.14 and earlier refuse the keys torch 2.15
    added, at the run's first CUDA allocation, after the model has loaded. None when it reads them all."""
    import importlib.metadata

    from packaging.version import Version

    newer = parse_allocator_conf(allocator_conf, why).torch_215_keys() if allocator_conf else ()
    version = importlib.metadata.version("torch") if newer else None
    if version is None or Version(version).release >= (2, 15):
        return None
    one = len(newer) == 1
    return (f"{why}: {' and '.join(newer)} {'needs' if one else 'need'} torch 2.15 or later, and torch {version} is "
            f"installed, which refuses {'it' if one else 'them'}: pip install 'torch>=2.15', or leave "
            f"{'it' if one else 'them'} out")


def run_files(folder: Path) -> list[Path]:
    """What an earlier run left in `folder` (checkpoint-N/, final/, the log, the accelerate config) and nothing
    else a user keeps there."""
    if not folder.is_dir():
        return []
    checkpoints = [p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name.partition("-")[2].isdigit()]
    final = [folder / "final"] if (folder / "final").is_dir() else []
    files = [folder / name for name in (LOG_NAME, CONFIG_NAME, RECORD_NAME, OOM_SNAPSHOT_NAME)
             if (folder / name).is_file()]
    return sorted(checkpoints) + final + files


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-N folder with the largest N, as Trainer finds it."""
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    return Path(found) if found else None


def check_output_dir(setup: RunSetup) -> Path | None:
    """The output folder can be written and holds no earlier run, unless --resume (returns the checkpoint to
    continue from) or --overwrite (its files are removed only when training starts)."""
    folder = setup.output_dir
    if setup.resume and setup.overwrite:
        raise VramPlanError(f"--resume continues the run in {folder} and --overwrite starts it afresh: pass one of "
                            "them")
    check_writable(folder / LOG_NAME, "--output-dir")
    leftovers = [] if launched_worker() else run_files(folder)  # a launched process finds its launcher's config
    if setup.resume:
        checkpoint = last_checkpoint(folder)
        if checkpoint is None and not restartable(leftovers):
            raise VramPlanError(f"--resume: {folder} holds no checkpoint-N folder to continue from; leave --resume "
                                "out to start a run there")
        return checkpoint  # None: a run stopped before its first checkpoint starts again from the beginning
    if leftovers and not setup.overwrite and not restartable(leftovers):
        checkpoint = last_checkpoint(folder)
        resume = f"--resume to continue it from {checkpoint.name}" if checkpoint else "--resume (with a checkpoint)"
        raise VramPlanError(f"--output-dir {folder} already holds a run ({', '.join(p.name for p in leftovers[:4])}"
                            f"{', ...' if len(leftovers) > 4 else ''}): pass {resume}, --overwrite to start afresh "
                            "(removing those files), or another --output-dir")
    return None


def restartable(leftovers: list[Path]) -> bool:
    """What a run stopped before its first checkpoint leaves (its log, its accelerate config): nothing to continue
    from and nothing worth keeping, so a new run may start there without --overwrite."""
    return bool(leftovers) and all(path.is_file() for path in leftovers)


def clear_previous_run(setup: RunSetup, keep: list[Path] | None = None) -> None:
    """With --overwrite, remove what the earlier run left (nothing else in the folder), once, in the main process;
    without it, only what a run stopped before its first checkpoint left. `keep`: what this run wrote already (the
    snapshot of a smoke step it fell back from)."""
    if launched_worker() or setup.resume and last_checkpoint(setup.output_dir) is not None:
        return
    leftovers = [path for path in run_files(setup.output_dir) if path not in (keep or [])]
    if not setup.overwrite and not restartable(leftovers):
        return
    for path in leftovers:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


@dataclass
class PreparedRun:
    """What the checks found: the dataset to train on and the checkpoint to continue from (--resume)."""

    dataset: Any
    resume_from: Path | None


def prepare(setup: RunSetup) -> PreparedRun:
    """Everything a run depends on, checked before anything is written: optional packages, the output folder, the
    model folder, the dataset, the chat template, the rewards."""
    check_dependencies(setup.train, setup.dry_run, setup.notes)
    if setup.on_cpu and setup.train.use_vllm:
        raise VramPlanError("--use-vllm needs a CUDA device: vLLM generates on the GPU (drop --use-vllm to try the "
                            "run on the CPU)")
    check_trl_runs_here(setup)
    resume_from = check_output_dir(setup)
    check_model_folder(setup.model_id)
    note_tokenizer_only(setup)
    check_hub_model(setup)
    return PreparedRun(prepared_dataset(setup), resume_from)


def check_trl_runs_here(setup: RunSetup) -> None:
    """TRL 1.15 scores log-probabilities only with its Triton kernel (trl/kernels/chunked_logprob.py, called from the
    fused LM head in trl/trainer/utils.py), which needs CUDA; 1.14 computes full logits with torch off CUDA, and 1.16
    chooses torch ops where Triton does not run. A run on a machine without CUDA would fail in its first step."""
    from vram_planner.model.trl_releases import installed_trl_version, parse_version

    parsed = parse_version(installed_trl_version() or "")
    if not setup.on_cpu or parsed is None or parsed[0][:2] != (1, 15):
        return
    refuse(setup, f"TRL {parsed[1]} scores log-probabilities only with a Triton kernel, which needs a CUDA device: "
                  "on this machine install TRL 1.16 or later (pip install 'trl>=1.16'), or run on a GPU")


def note_tokenizer_only(setup: RunSetup) -> None:
    """A multimodal model's folder with a tokenizer and no processor trains on text prompts: said, as a note."""
    if not tokenizer_only(setup.model_id):
        return
    from vram_planner.profiles import read_json

    config = read_json(Path(setup.model_id).expanduser() / "config.json")
    towers = [key for key in ("vision_config", "audio_config") if isinstance(config, dict) and key in config]
    if towers:
        setup.notes.append(f"{setup.model_id} has a tokenizer and no processor: the run trains on the text prompts "
                           f"with the tokenizer (its {' and '.join(k.partition('_')[0] for k in towers)} tower is "
                           "loaded but sees no input)")
