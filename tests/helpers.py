"""What several test modules share: model configs, running the CLI in-process or in a process of its own, paths
nothing can be written at, catalog models' architectures, an out-of-memory message, a time limit, models built as TRL builds them, a tokenizer
trained here (benchmarks/gpu_steps.py uses it too), the H100 recordings read once, and the benchmark scripts imported
as modules. Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from vram_planner.allocator.snapshot import Snapshot, load_snapshot
from vram_planner.cli import main
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.profiles import model_config

# `SomethingError:`, `KeyError`, `Exception`, a traceback: what a user should never read.
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception|Warning|Interrupt)\b|\bException\b|Traceback|"
                        r"StopIteration|SystemExit")
FIXTURES = Path(__file__).parent / "fixtures"
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
H100_SNAPSHOTS = FIXTURES / "snapshots" / "h100"

# Llama-3.2-1B's config.json facts (meta-llama/Llama-3.2-1B), independent of the shipped catalog.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
}


@functools.cache
def h100_snapshot(name: str) -> Snapshot:
    """A recording in tests/fixtures/snapshots/h100 as load_snapshot reads it, read once for the session: three test
    modules replay the same few, a few seconds each. Shared, so a test must not change it."""
    return load_snapshot(H100_SNAPSHOTS / name)


def family_fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("tiny-*.json"))


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def json_of(capsys, *args: str) -> tuple[int, dict]:
    """A command's exit code (0 or 1: a verdict) and its --json document."""
    code, out, err = run(capsys, *args, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


def one_line_error(capsys, *args) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def cli_in_a_subprocess(*args: str, setup: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """The real command's output in a process of its own, after `setup` (Python code): torch and libraries that
    never set logging up write to the process's own stderr, which pytest's handlers would take in this process."""
    code = f"import sys\n{setup}\nfrom vram_planner.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def library_warning_before(*targets: str) -> str:
    """Setup code for cli_in_a_subprocess: each target ('module:attribute.path') first logs a warning as bitsandbytes
    0.50 does when PEFT imports it on a CPU with AVX512-BF16 (through logging's last-resort handler)."""
    return ("import importlib, logging\n"
            "def noisy(function):\n"
            "    def call(*args, **kwargs):\n"
            "        logging.getLogger('bitsandbytes').warning('a library warning')\n"
            "        return function(*args, **kwargs)\n"
            "    return call\n"
            f"for target in {list(targets)!r}:\n"
            "    module, _, path = target.partition(':')\n"
            "    *parents, name = path.split('.')\n"
            "    owner = importlib.import_module(module)\n"
            "    for parent in parents:\n"
            "        owner = getattr(owner, parent)\n"
            "    setattr(owner, name, noisy(getattr(owner, name)))\n")


def unwritable_targets(tmp_path) -> dict[str, str]:
    """Paths no one can write a file at, root included (chmod does not stop root)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    (tmp_path / "a-folder").mkdir()
    return {"below a file": str(a_file / "plan.png"), "deeper below a file": str(a_file / "x" / "plan.png"),
            "a folder": str(tmp_path / "a-folder"), "a folder with a slash": str(tmp_path / "a-folder") + "/",
            "in /proc": "/proc/plan.png", "below /proc": "/proc/vram-plan-nothing/plan.png"}


# The smallest run of the tiny model: two sequences of 8 tokens on a 24 GiB card.
SMALL = ["--gpu", "24GiB", "--per-device-train-batch-size", "2", "--num-generations", "2",
         "--max-completion-length", "8", "--max-prompt-length", "128"]


def bad_run(capsys, tmp_path, model, *extra):
    out = tmp_path / "run"
    err = one_line_error(capsys, "run", "--model", str(model), "--output-dir", str(out), *SMALL, *extra)
    assert not out.exists()
    return err


# The seeds' laptop OOM: TRL 1.14's fp32 logits of 4 sequences of ~1000 tokens of Llama's vocabulary.
CURRENT = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total "
           "capacity of 15.73 GiB of which 1.02 GiB is free. Process 4242 has 14.70 GiB memory in use. Including "
           "non-PyTorch memory, this process has 14.70 GiB memory in use. Of the allocated memory 11.82 GiB is "
           "allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
           "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


@contextlib.contextmanager
def within_seconds(limit: float):
    """Fail (instead of hanging) when the block runs longer than `limit` seconds of wall time."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def build_on_meta(config: dict[str, Any]):
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def parameter_count(model) -> int:
    """Unique parameters, tied weights once, as model.parameters() yields them."""
    return sum(p.numel() for p in model.parameters())


def linear_names(model) -> set[str]:
    """The linear layers' names in the decoder layers (a multimodal model's vision tower has layers of its own)."""
    import torch

    decoder = model.get_decoder()
    return {name.rsplit(".", 1)[-1] for name, mod in decoder.named_modules()
            if isinstance(mod, torch.nn.Linear) and "layers." in name}


def math_sample_tokenizer():
    """A byte-level BPE tokenizer of 400 tokens trained on the bundled prompts: no hub needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vram_planner.run.train_data import load_prompts

    texts = [row["prompt"] + row["answer"] for row in load_prompts("math-sample")]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>",
                                                                                            "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def launched(text: str, tmp_path: Path) -> Any:
    """What `accelerate launch --config_file FILE train_grpo.py` makes of an accelerate config file's text, as
    accelerate's own launcher parses and checks it (no GPU needed)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from vram_planner.model.accelerate_config import CONFIG_FILE, SCRIPT_FILE

    path = tmp_path / CONFIG_FILE
    path.write_text(text)
    ClusterConfig.from_yaml_file(path)  # unknown keys are refused here
    args = launch_command_parser().parse_args(["--config_file", str(path), SCRIPT_FILE])
    return _validate_launch_command(args)[0]


def benchmark_module(name: str) -> Any:
    """benchmarks/<name>.py imported as the scripts import each other (their folder on the path while it loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def catalog_architecture(name: str) -> ModelArchitecture:
    """A catalog model's architecture, as the analytic model reads it."""
    return ModelArchitecture.from_config(model_config(name)[0])
