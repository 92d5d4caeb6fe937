"""Validation at the edges of the analytic model: every model plans, and every bad input is one VramPlanError."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import FIXTURES, LLAMA_1B, family_fixture_files
from vram_planner import engine
from vram_planner.errors import ConfigError, ProfileError, VramPlanError
from vram_planner.model import trl_releases
from vram_planner.model.architecture import ModelArchitecture, supported_model_types
from vram_planner.model.calibration import calibration_for
from vram_planner.model.search import Plan
from vram_planner.model.spec import TrainingConfig, with_changes
from vram_planner.model.verdict import Verdict
from vram_planner.profiles import GpuProfile, models

CARD = GpuProfile(name="card", total_memory_gib=80)
EVERY_MODEL = [m.name for m in models()] + [str(p) for p in family_fixture_files()]


def model_id(name: str) -> str:
    return name.rsplit("/", 1)[-1]


# 1. Every catalog model and every fixture architecture plans (the phi3 family's fused projections included).

@pytest.mark.parametrize("model", EVERY_MODEL, ids=model_id)
@pytest.mark.parametrize("settings", [{}, {"lora_r": 16, "gradient_checkpointing": False}],
                         ids=["defaults", "lora-no-checkpointing"])
def test_every_model_is_checked_and_planned(model, settings):
    verdict = engine.check(model, CARD, settings)
    assert isinstance(verdict, Verdict) and verdict.estimate.peak_bytes > verdict.estimate.params
    assert all(math.isfinite(v) and v >= 0 for p in verdict.estimate.phases for v in p.components.values())
    assert isinstance(engine.plan(model, "t4", settings), Plan)


# 2. A change the GPU forces on the config is refused with the model's reason, never pydantic's report.

@pytest.mark.parametrize("card", ["t4", "v100", "rtx2060"])
def test_float16_full_fine_tuning_on_a_card_without_native_bf16_runs_bf16_emulated_and_fp16_is_one_clear_problem(
        card):
    """A pre-Ampere card emulates bf16 (torch.cuda.is_bf16_supported() is True there, so TRL's default bf16 runs):
    float16 weights trained in full keep that default, with a note, since fp16 autocast cannot train them; asked
    for explicitly, fp16 is refused in one line with the grad scaler's reason."""
    verdict = engine.check("Llama-3.2-1B", card, {"dtype": "float16"})
    assert verdict.train.mixed_precision == "bf16"
    assert any("has no native bf16: torch emulates it" in note for note in verdict.estimate.notes)
    with pytest.raises(ConfigError) as info:
        engine.check("Llama-3.2-1B", card, {"dtype": "float16", "mixed_precision": "fp16"})
    message = str(info.value)
    assert "grad scaler" in message and "dtype float32" in message
    assert "ValidationError" not in message and "\n" not in message


def test_with_changes_raises_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        with_changes(TrainingConfig(), num_generations=1)
    with pytest.raises(ConfigError, match="per_device_train_batch_size should be greater than 0"):
        with_changes(TrainingConfig(), per_device_train_batch_size=0)


# 3. config.json: positive integer sizes of the right type, decoders only.

@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                                 "vocab_size", "intermediate_size", "head_dim"])
@pytest.mark.parametrize("value", [0, -64, 2.5, 64.0, "64", True, 2**40])
def test_config_sizes_must_be_positive_integers(key, value):
    with pytest.raises(ProfileError) as info:
        ModelArchitecture.from_config({**LLAMA_1B, key: value}, name="mine.json")
    assert str(info.value) == f"model config mine.json: {key} should be a positive integer (got {value!r})"


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
def test_config_flags_must_be_booleans(key):
    with pytest.raises(ProfileError, match=f"{key} should be true or false \\(got 'false'\\)"):
        ModelArchitecture.from_config({**LLAMA_1B, key: "false"})


def test_heads_must_divide_into_key_value_groups_and_fit_the_hidden_size():
    with pytest.raises(ProfileError, match=r"num_attention_heads \(32\) should be a multiple of num_key_value_heads"):
        ModelArchitecture.from_config({**LLAMA_1B, "num_key_value_heads": 5})
    with pytest.raises(ProfileError, match="smaller than num_attention_heads"):
        ModelArchitecture.from_config({**LLAMA_1B, "hidden_size": 16, "head_dim": None})


@pytest.mark.parametrize("text_config", [[1, 2], "gemma3_text", 7, None])
def test_a_gemma3_text_config_that_is_not_a_mapping(text_config):
    config = json.loads((FIXTURES / "tiny-gemma3.json").read_text())
    wrapped = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": text_config, "vision_config": {}}
    with pytest.raises(ProfileError, match="text_config should be a mapping"):
        ModelArchitecture.from_config(wrapped)
    assert ModelArchitecture.from_config({**wrapped, "text_config": config}).exact


def test_a_vision_config_that_is_not_a_mapping_or_lacks_sizes():
    text = json.loads((FIXTURES / "tiny-gemma3.json").read_text())
    with pytest.raises(ProfileError, match="vision_config should be a mapping"):
        ModelArchitecture.from_config({"model_type": "gemma3", "text_config": text, "vision_config": [1]})
    with pytest.raises(ProfileError, match="vision_config lacks hidden_size"):
        ModelArchitecture.from_config({"model_type": "gemma3", "text_config": text,
                                       "vision_config": {"model_type": "siglip_vision_model"}})


BERT = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
        "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "type_vocab_size": 2}
T5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True,
      "vocab_size": 32128, "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8}
MIXTRAL = {**LLAMA_1B, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8}


@pytest.mark.parametrize("config,problem", [
    (BERT, "(BertForMaskedLM) is not a decoder language model"),
    ({**BERT, "architectures": None}, "names no ...ForCausalLM architecture"),
    (T5, "is an encoder-decoder model"),
    (MIXTRAL, "is a mixture-of-experts model (num_local_experts 8)"),
    ({"model_type": "some_vlm", "architectures": ["SomeVlmModel"], "text_config": {**BERT, "architectures": None}},
     "(SomeVlmModel) is not a decoder language model"),
    ({"model_type": "some_vlm", "text_config": {**BERT, "architectures": None}}, "names no ...ForCausalLM"),
])
def test_only_dense_decoders_are_planned_and_the_refusal_lists_the_supported_types(config, problem):
    with pytest.raises(ProfileError) as info:
        ModelArchitecture.from_config(config, name="its.json")
    message = str(info.value)
    assert problem in message and "model config its.json" in message
    assert "llama, mistral, phi, phi3, qwen2, qwen3" in message and set(supported_model_types()) >= {"gemma3"}


def test_a_bert_config_file_is_refused_by_check_and_plan(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BERT))
    for call in (engine.check, engine.plan):
        with pytest.raises(ProfileError, match="not a decoder language model"):
            call(str(path), CARD)


def test_an_unknown_causal_lm_is_read_as_llama_style_with_a_note():
    arch = ModelArchitecture.from_config({**LLAMA_1B, "model_type": "brand_new",
                                          "architectures": ["BrandNewForCausalLM"]})
    assert not arch.exact and arch.params == 1_235_814_400
    wrapped = {"model_type": "some_vlm", "architectures": ["SomeVlmForConditionalGeneration"],
               "text_config": {**LLAMA_1B, "model_type": "some_text", "architectures": None}}
    assert ModelArchitecture.from_config(wrapped).params == 1_235_814_400


@pytest.mark.slow
def test_a_huge_layer_count_is_counted_not_looped_over():
    config = json.loads((FIXTURES / "tiny-gemma3.json").read_text())
    started = time.perf_counter()
    arch = ModelArchitecture.from_config({**config, "num_hidden_layers": 2**31 - 1})
    assert time.perf_counter() - started < 1
    assert arch.sliding_layers == (2**31 - 1) - (2**31 - 1) // 6


@pytest.mark.parametrize("text,problem", [
    ("", "is empty"), ("[1, 2]", "holds a JSON array, not an object"), ('"llama"', "holds a JSON string"),
    ("{not json", "is not valid JSON"),
])
def test_a_model_file_that_is_not_a_config_object(tmp_path, text, problem):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=problem):
        engine.check(str(path), CARD)


def test_random_bytes_as_a_model_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ProfileError, match="is not a JSON file"):
        engine.check(str(path), CARD)


def test_an_unreadable_model_folder(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_1B))
    folder.chmod(0)
    if os.geteuid() == 0:  # root (CI) reads any folder: answer as the kernel answers everyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != folder and real_access(path, mode))
    try:
        with pytest.raises(ProfileError, match="cannot read the model folder"):
            engine.check(str(folder), CARD)
    finally:
        folder.chmod(0o755)


# 4. LoRA targets are the architecture's module names.

@pytest.mark.parametrize("call", [engine.check, engine.plan])
def test_unknown_lora_targets_are_refused_with_the_closest_name(call):
    with pytest.raises(ConfigError) as info:
        call("Llama-3.2-1B", CARD, {"lora_r": 8, "lora_target_modules": "qproj,v_proj"})
    message = str(info.value)
    assert "lora_target_modules 'qproj' (did you mean 'q_proj'?) is not a linear layer of Llama-3.2-1B" in message
    assert "choose from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear" in message


def test_lora_targets_follow_the_family():
    with pytest.raises(ConfigError, match="'q_proj' \\(did you mean 'qkv_proj'\\?\\), 'v_proj' .* are not linear"):
        engine.check("Phi-3-mini-4k-instruct", CARD, {"lora_r": 8, "lora_target_modules": "q_proj,v_proj"})
    fused = engine.check("Phi-3-mini-4k-instruct", CARD, {"lora_r": 8, "lora_target_modules": "qkv_proj,gate_up_proj"})
    assert 0 < fused.estimate.trainable_params < engine.check("Phi-3-mini-4k-instruct", CARD,
                                                           {"lora_r": 8}).estimate.trainable_params
    assert engine.check("Llama-3.2-1B", CARD, {"lora_r": 8, "lora_target_modules": "all-linear"}).fits


def test_lora_targets_of_a_model_read_as_llama_style_are_left_to_peft(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_1B, "model_type": "neox_like", "architectures": ["NeoxLikeForCausalLM"]}))
    verdict = engine.check(str(path), CARD, {"lora_r": 8, "lora_target_modules": "query_key_value"})
    assert any("read as a Llama-style decoder" in note for note in verdict.estimate.notes)


@pytest.mark.parametrize("targets", [",,,", "", " , ", [], ["q_proj", ""], ["all-linear", "q_proj"]])
def test_empty_lora_target_lists_are_refused(targets):
    with pytest.raises(ConfigError, match="lora_target_modules should be"):
        engine.check("Llama-3.2-1B", CARD, {"lora_r": 8, "lora_target_modules": targets})


def test_unknown_lora_targets_are_refused_before_the_trace_starts():
    with pytest.raises(ConfigError, match="did you mean 'q_proj'"):
        engine.trace("Llama-3.2-1B", CARD, {"lora_r": 8, "lora_target_modules": "qproj"})


# 5. --trl-version: normalised, and refused outside the supported range.

@pytest.mark.parametrize("given,normalised,lm_head", [
    ("0.14", "0.14.0", "full_logits"), ("1.16", "1.16.0", "fused_chunked"), ("1.16.3", "1.16.3", "fused_chunked"),
    ("1.16.0.dev0", "1.16.0.dev0", "fused_chunked"), ("1.16.0rc1", "1.16.0rc1", "fused_chunked"),
    ("1.14.2", "1.14.2", "full_logits"), (" 1.15.0 ", "1.15.0", "fused_chunked"),
])
def test_trl_versions_are_normalised(given, normalised, lm_head):
    release = trl_releases.trl_release(given)
    assert (release.version, release.lm_head) == (normalised, lm_head)


@pytest.mark.parametrize("given,problem", [
    ("2.0", "trl_version 2.0.0 is outside the TRL releases vram-plan knows (0.14.0 to 1.16.x)"),
    ("1.17.0", "trl_version 1.17.0 is outside"), ("1.17.0.dev0", "trl_version 1.17.0.dev0 is outside"),
    ("0.13.9", "trl_version 0.13.9 is outside"), ("0.1", "trl_version 0.1.0 is outside"),
    ("-1", "trl_version '-1' is not a version number"), ("latest", "'latest' is not a version number"),
    ("1..2", "is not a version number"), ("", "'' is not a version number"),
])
def test_trl_versions_outside_the_range_are_refused_in_one_line(given, problem):
    with pytest.raises(ConfigError) as info:
        engine.check("Llama-3.2-1B", CARD, trl_version=given)
    assert problem in str(info.value) and "pass --trl-version" not in str(info.value)


@pytest.mark.parametrize("installed", ["1.17.2", "3.0.0", "0.12.0", "not-a-version"])
def test_an_installed_trl_outside_the_range_is_planned_as_the_newest_known_with_a_note(installed_trl, installed):
    installed_trl(installed)
    verdict = engine.check("Llama-3.2-1B", CARD)
    assert verdict.context.release.version == trl_releases.NEWEST_KNOWN
    assert verdict.context.release.lm_head == "fused_chunked"
    assert any(f"the installed TRL {installed} is outside the releases vram-plan knows" in note
               and "--trl-version" in note for note in verdict.estimate.notes)


def test_an_installed_trl_inside_the_range_is_planned_as_itself_without_a_note(installed_trl):
    installed_trl("1.14.1")
    verdict = engine.check("Llama-3.2-1B", CARD)
    assert verdict.context.release.version == "1.14.1" and verdict.context.release.lm_head == "full_logits"
    assert not any("installed TRL" in note for note in verdict.estimate.notes)


def test_a_row_a_user_adds_for_a_newer_trl_extends_the_range(tmp_path, monkeypatch):
    shipped = (trl_releases.profile_dirs()[0] / "trl.toml").read_text()
    first = shipped.index("[[release]]")
    newest = shipped[first:shipped.index("[[release]]", first + 1)]
    (tmp_path / "trl.toml").write_text(newest.replace('min_version = "1.15.0"', 'min_version = "1.17.0"')
                                       .replace("default_max_completion_length = 512",
                                                "default_max_completion_length = 1024"))
    monkeypatch.setenv("VRAM_PLAN_PROFILES", str(tmp_path))
    trl_releases.trl_releases.cache_clear()
    trl_releases.trl_release.cache_clear()
    try:
        assert trl_releases.trl_release("1.17.2").default_max_completion_length == 1024
        assert trl_releases.trl_release("1.16.0").default_max_completion_length == 512
        assert trl_releases.supported_range() == "0.14.0 to 1.17.x"
    finally:
        trl_releases.trl_releases.cache_clear()
        trl_releases.trl_release.cache_clear()


def test_a_malformed_trl_row_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "trl.toml").write_text('[[release]]\nmin_version = "one"\n')
    monkeypatch.setenv("VRAM_PLAN_PROFILES", str(tmp_path))
    trl_releases.trl_releases.cache_clear()
    try:
        with pytest.raises(ProfileError, match=r"trl.toml release #1: min_version: String should match pattern"):
            trl_releases.trl_releases()
    finally:
        trl_releases.trl_releases.cache_clear()


# 6. Non-finite numbers.

@pytest.mark.parametrize("settings,flag", [
    ({"beta": math.inf}, "beta"), ({"beta": math.nan}, "beta"), ({"beta": -math.inf}, "beta"),
    ({"lora_r": 8, "lora_dropout": math.nan}, "lora_dropout"),
    ({"use_vllm": True, "vllm_gpu_memory_utilization": math.nan}, "vllm_gpu_memory_utilization"),
])
def test_non_finite_knobs_are_one_clear_line(settings, flag):
    with pytest.raises(ConfigError) as info:
        engine.check("Llama-3.2-1B", CARD, settings)
    assert str(info.value).startswith(f"{flag} should be a finite number")


@pytest.mark.parametrize("margin", [math.nan, math.inf, -0.1, 0.9, "0.05", True, None])
def test_the_safety_margin_is_a_share_of_the_card(margin):
    for call in (engine.check, engine.plan, engine.make_context):
        with pytest.raises(ConfigError, match="safety_margin should be a share of the card from 0 to 0.5"):
            call("Llama-3.2-1B", CARD, safety_margin=margin)


# 7. Calibration files of the wrong shape: one line naming the file, the field and the problem.

@pytest.mark.parametrize("content,problem", [
    ({"allocator_overhead_fraction": "lots"}, "allocator_overhead_fraction: Input should be a valid number"),
    ({"cuda_context_bytes": -1}, "cuda_context_bytes: Input should be greater than or equal to 0 (got -1)"),
    ({"backward_mlp_bytes": -4.0}, "backward_mlp_bytes: Input should be greater than or equal to 0"),
    ({"unknown_coefficient": 1}, "unknown_coefficient: Extra inputs are not permitted"),
    ([1, 2], "Input should be a dictionary or an instance of Calibration (got [1, 2])"),
    ("calibration", "Input should be a dictionary"),
])
def test_calibrations_of_the_wrong_shape_are_one_line(tmp_path, content, problem):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ProfileError) as info:
        engine.check("Llama-3.2-1B", CARD, calibration=path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a valid calibration: ") and problem in message
    assert "\n" not in message and "validation error" not in message


@pytest.mark.parametrize("text,problem", [("", "is empty"), ("NaN", "Input should be a dictionary"),
                                          ('{"inference_mlp_bytes": NaN}', "inference_mlp_bytes: Input should be "
                                                                           "a finite number"),
                                          ("{", "is not valid JSON")])
def test_calibration_text_that_is_not_a_calibration(tmp_path, text, problem):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=problem):
        calibration_for("card", path)


def test_random_bytes_and_folders_as_calibrations(tmp_path):
    path = tmp_path / "cal.json"
    path.write_bytes(os.urandom(64) + b"\xff\xfe")
    with pytest.raises(ProfileError, match="is not a JSON file"):
        calibration_for("card", path)
    with pytest.raises(ProfileError, match="cannot read"):
        calibration_for("card", tmp_path)
    with pytest.raises(ProfileError, match="No such file"):
        calibration_for("card", str(tmp_path / "missing.json"))


# The library answers with a result or one VramPlanError for inputs of the wrong type, too.

@pytest.mark.parametrize("call", [
    lambda: engine.check(None, CARD),
    lambda: engine.check("", CARD),
    lambda: engine.check(["Llama-3.2-1B"], CARD),
    lambda: engine.check("a" * 5000, CARD),  # longer than any file name: not a path
    lambda: engine.check("a\x00b", CARD),
    lambda: engine.check("Llama-3.2-1B", None),
    lambda: engine.check("Llama-3.2-1B", 24),
    lambda: engine.check("Llama-3.2-1B", CARD, ["lora_r", 8]),
    lambda: engine.check("Llama-3.2-1B", CARD, {3: 4}),
    lambda: engine.check("Llama-3.2-1B", CARD, {"lora_r": 8, "lora_target_modules": 5}),
    lambda: engine.check("Llama-3.2-1B", CARD, trl_version=1.16),
    lambda: engine.check("Llama-3.2-1B", CARD, trl_version=[1]),
    lambda: engine.check("Llama-3.2-1B", CARD, calibration=5),
    lambda: engine.plan("Llama-3.2-1B", CARD, {"lora_r": "eight"}),
])
def test_wrong_types_are_vram_plan_errors(call):
    with pytest.raises(VramPlanError):
        call()


# 8. An unknown hub id offline is one line within seconds; the online path stays transformers' own.

def run_cli(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vram_planner", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    return done, time.perf_counter() - started


def hub_env(tmp_path, endpoint: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # an empty cache
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def test_an_unknown_hub_id_without_network_is_one_line_within_seconds(tmp_path):
    # 127.0.0.1:9 (discard) refuses connections: a machine without network, whatever this one has
    done, seconds = run_cli("check", "--gpu", "24GiB", "--model", "someone/not-a-real-model",
                            env=hub_env(tmp_path, "http://127.0.0.1:9"))
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: cannot read 'someone/not-a-real-model'")
    assert "cannot be reached" in done.stderr and "not in the local cache" in done.stderr
    assert seconds < 10


@pytest.mark.parametrize("model", ["a b/c", "someone/x..y", "-x/y", "someone/" + "a" * 120])
def test_a_name_that_cannot_be_a_hub_id_is_refused_without_asking_the_hub(model):
    with pytest.raises(VramPlanError, match="is neither a catalog model .* nor a hub id"):
        engine.check(model, CARD)


COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(BaseHTTPRequestHandler):
    """The hub's resolve endpoint for one repository, someone/tiny-qwen2; every other repository is unknown."""

    config = (FIXTURES / "tiny-qwen2.json").read_bytes()

    def do_HEAD(self):  # noqa: N802 (http.server's naming)
        self._answer(body=False)

    def do_GET(self):  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        if self.path == "/":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.startswith("/someone/tiny-qwen2/resolve/main/config.json"):
            self.send_response(200)
            for key, value in (("X-Repo-Commit", COMMIT), ("ETag", '"tiny-qwen2-config"'),
                               ("Content-Length", str(len(self.config))), ("Content-Type", "application/json")):
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(self.config)
        else:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
def test_online_a_hub_id_is_read_by_transformers_and_an_unknown_one_is_one_line(tmp_path, fake_hub):
    env = hub_env(tmp_path, fake_hub)
    done, _ = run_cli("check", "--gpu", "24GiB", "--model", "someone/tiny-qwen2", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["params"] == ModelArchitecture.from_config(
        json.loads(FakeHub.config)).params
    done, seconds = run_cli("check", "--gpu", "24GiB", "--model", "someone/not-a-real-model", env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: cannot read 'someone/not-a-real-model' from the Hugging Face hub")
    # offline now: the config read above comes from the cache, without a request
    done, _ = run_cli("check", "--gpu", "24GiB", "--model", "someone/tiny-qwen2", "--json",
                      env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert done.returncode == 0 and done.stderr == "", done.stderr


# On the command line: exactly one line, exit code 2, no exception class name, for every command that plans.

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of "
       "15.73 GiB of which 1.02 GiB is free.")
BAD_KNOBS = [
    (["--gpu", "t4", "--dtype", "float16", "--mixed-precision", "fp16"],
     "full fine-tuning of float16 weights with fp16 mixed precision fails in the grad scaler"),
    (["--trl-version", "2.0"], "--trl-version 2.0.0 is outside the TRL releases vram-plan knows (0.14.0 to 1.16.x)"),
    (["--trl-version", "-1"], "--trl-version '-1' is not a version number"),
    (["--beta", "inf"], "--beta should be a finite number (got inf)"),
    (["--beta", "nan"], "--beta should be a finite number (got nan)"),
    (["--lora-r", "8", "--lora-dropout", "nan"], "--lora-dropout should be a finite number"),
    (["--use-vllm", "--vllm-gpu-memory-utilization", "nan"], "--vllm-gpu-memory-utilization should be a finite"),
    (["--lora-r", "8", "--lora-target-modules", "qproj"], "'qproj' (did you mean 'q_proj'?) is not a linear layer"),
    (["--lora-r", "8", "--lora-target-modules", ",,,"], "--lora-target-modules should be a comma-separated list"),
]


def one_line_error(capsys, args: list[str]) -> str:
    from vram_planner.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Error:" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["plan", "check", "trace", "advise"])
@pytest.mark.parametrize("args,expected", BAD_KNOBS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_knobs_are_one_line_for_every_command(capsys, tmp_path, command, args, expected):
    log = tmp_path / "crash.log"
    log.write_text(OOM)
    prefix = [command, str(log)] if command == "advise" else [command]
    gpu = [] if "--gpu" in args else ["--gpu", "rtx4090"]
    assert expected in one_line_error(capsys, [*prefix, *gpu, "--model", "Llama-3.2-1B", *args])


@pytest.mark.parametrize("command", ["plan", "check", "trace"])
def test_bad_context_options_are_one_line_for_every_command(capsys, tmp_path, command):
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"cuda_context_bytes": "half a GiB"}))
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps(BERT))
    base = [command, "--gpu", "rtx4090", "--model", "Llama-3.2-1B"]
    assert "--safety-margin should be a share" in one_line_error(capsys, [*base, "--safety-margin", "nan"])
    err = one_line_error(capsys, [*base, "--calibration", str(calibration)])
    assert f"{calibration} is not a valid calibration: cuda_context_bytes: Input should be a valid integer" in err
    err = one_line_error(capsys, [command, "--gpu", "rtx4090", "--model", str(bert)])
    assert "(BertForMaskedLM) is not a decoder language model" in err and "qwen3" in err


@pytest.mark.slow
def test_run_refuses_bad_knobs_before_it_starts(capsys, tmp_path):
    err = one_line_error(capsys, ["run", "--gpu", "rtx4090", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                                  "--output-dir", str(tmp_path / "out"), "--lora-r", "8", "--lora-target-modules",
                                  "qproj", "--dry-run"])
    assert "did you mean 'q_proj'" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["plan", "check"])
@pytest.mark.parametrize("model", ["Phi-3-mini-4k-instruct", "Phi-3.5-mini-instruct", "Phi-4-mini-instruct"])
def test_the_phi3_family_is_planned_on_the_command_line(capsys, command, model):
    from vram_planner.cli import main

    code = main([command, "--gpu", "rtx4090", "--model", model, "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 1) and err == "" and json.loads(out)["params"] > 3.8e9


def test_an_unknown_setting_is_reported_even_when_its_value_is_none():
    # None means "not given" for a known knob, but a misspelt one must not vanish with it
    with pytest.raises(ConfigError, match="unknown setting per_device_train_batch .*did you mean"):
        engine.check("Llama-3.2-1B", CARD, {"per_device_train_batch": None})
    assert engine.check("Llama-3.2-1B", CARD, {"beta": None}).train.beta == 0.0
