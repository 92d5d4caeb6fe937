"""The models of a traced step on fake tensors, built from a config.json as TRL 1.16 sets them up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vram_planner.errors import VramPlanError
from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.counter import REFERENCE, WEIGHTS, LiveBytes


@dataclass
class Session:
    """Everything the phases share: the fake-tensor world, the counter, the models and the run's shape."""

    train: TrainingConfig
    fake_mode: Any
    tracker: LiveBytes
    model: Any = None  # the policy (a PeftModel with LoRA)
    ref_model: Any = None  # a second full model when beta != 0 without LoRA
    state_bytes: int = 0  # the optimizer states the first step leaves behind
    optimizer: Any = None  # kept after the first step, so a real device carries its states into the next
    trainer: Any = None  # the installed GRPOTrainer whose scoring and loss run (vram_planner.tracing.trainer)
    engine: Any = None  # DeepSpeed's engine around `model` under ZeRO (vram_planner.tracing.zero)

    device_type: str = "cpu"  # "cuda" when the probe runs the phases on a real device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.train.mixed_precision)

    def autocast(self) -> Any:
        """accelerate's autocast, on the session's device.

        On the CPU, autocast casts the same matmul-like ops (linear, matmul, SDPA) to the low-precision dtype and
        caches casts of fp32 leaf weights the same way; unlike CUDA's it does not upcast exp, log, softmax and a
        few others to fp32, which a decoder's forward never feeds low-precision tensors (RMSNorm and rotary
        upcast themselves, eager attention's softmax names its dtype).
        """
        dtype = self.autocast_dtype
        return torch.autocast(self.device_type, dtype=dtype) if dtype else contextlib.nullcontext()

    def generation_autocast(self) -> Any:
        """The autocast generate() runs under: accelerate wraps the forward of the model it prepares, which a
        transformers model's generate() calls; PEFT's generate() calls the base model's generate() and its own,
        unwrapped forward, so LoRA generates without autocast (in the weights' dtype)."""
        return self.autocast() if self.base_model is self.model else contextlib.nullcontext()

    @property
    def base_model(self) -> Any:
        """The transformers model under PEFT's wrappers: the one TRL patches with the fused LM head."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model


def build_session(arch_config: dict[str, Any], train: TrainingConfig) -> Session:
    """Build the policy (and reference) model from a config.json dict on fake tensors, as TRL 1.16 sets it up.

    The models are built on the meta device (no init compute, and PEFT's Module.to() calls work there; on fake
    parameters they fail on the weakref FakeTensorMode keeps to each one), then every tensor is replaced by a fake
    CPU tensor of the same shape, strides and dtype. Tied weights stay tied.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real tensors passed in (module-level constants in modeling code) are small; let them through.
    session = Session(train=train, fake_mode=FakeTensorMode(allow_non_fake_inputs=True), tracker=LiveBytes())
    with torch.device("meta"):
        model = _build_model(arch_config, train)
        if train.load_in_4bit:
            _quantize_on_load(model, train)
        if train.uses_lora:
            model = _with_adapters(model, train)
        if train.computes_ref_logps and not train.uses_lora:
            session.ref_model = _build_model(arch_config, train)
        cast_heads(model, session.ref_model, train)
    with session.tracker.tagged(WEIGHTS, "loading the model"):  # the moment of their allocation events
        if train.load_in_4bit:
            session.model = _loaded_in_4bit(model, session, getattr(torch, train.dtype))
        else:
            session.model = _on_fake_tensors(model, session.fake_mode)
        _track_in_layers(session.tracker, session.model, WEIGHTS)
        if session.ref_model is not None:
            session.ref_model = _on_fake_tensors(session.ref_model, session.fake_mode)
            _track_in_layers(session.tracker, session.ref_model, REFERENCE)
    add_fused_heads(session)
    return session


def _track_in_layers(tracker: LiveBytes, model: Any, tag: str) -> None:
    """Count the model's parameters and buffers as `tag`, each in its decoder layer (`Event.layer`); 4-bit weights'
    quantization states are counted as `_loaded_in_4bit` makes them."""
    layer_of = {id(t): index for index, layer in enumerate(decoder_layers(model))
                for t in [*layer.parameters(), *layer.buffers()]}
    for t in [*model.parameters(), *model.buffers()]:
        tracker.layer = layer_of.get(id(t), -1)
        tracker.track(t, tag)
    tracker.layer = -1


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers model (its text model's, for a multimodal one; under PEFT's wrapper, its
    base model's); none for no model."""
    if model is not None and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if model is None or not hasattr(model, "get_decoder"):
        return []
    return list(getattr(model.get_decoder(), "layers", None) or [])


def cast_heads(model: Any, ref_model: Any, train: TrainingConfig) -> None:
    """GRPOTrainer.__init__'s `cast_lm_head_to_fp32` on the policy (PEFT's wrapper, as TRL has it by then) and the
    reference model."""
    if train.cast_lm_head_to_fp32:
        for target in (model, ref_model):
            if target is not None:
                _cast_lm_head_to_fp32(target)


def add_fused_heads(session: Session) -> None:
    """TRL's fused LM head on the policy (log-probs and entropies) and the reference (log-probs), where the release
    scores through it (grpo_trainer.py 1.16.0:1066-1077)."""
    if not uses_fused_lm_head(session.train):
        return
    _add_fused_head(session.base_model, ("log_probs", "entropy"), session.train.cast_lm_head_to_fp32)
    if session.ref_model is not None:
        _add_fused_head(session.ref_model, ("log_probs",), session.train.cast_lm_head_to_fp32)


def uses_fused_lm_head(train: TrainingConfig) -> bool:
    """TRL 1.15 and later patch the model with a fused LM head, which their GRPOTrainer scores through; older releases
    score with full logits."""
    return train.release.lm_head == "fused_chunked"


def _build_model(arch_config: dict[str, Any], train: TrainingConfig) -> Any:
    import transformers

    from vram_planner.tracing.shims import model_dtype_keyword

    try:
        config = transformers.AutoConfig.for_model(**arch_config)
        from_config = transformers.AutoModelForCausalLM.from_config
        model = from_config(config, attn_implementation=train.attn_implementation,
                            **{model_dtype_keyword(transformers.__version__): getattr(torch, train.dtype)})
    except (ValueError, KeyError) as exc:  # unknown model_type, an attention implementation the model lacks
        reason = str(exc).split(". Should contain one of")[0].strip().splitlines()[0][:300]
        raise VramPlanError(f"transformers {transformers.__version__} cannot build this model for the trace "
                            f"({reason}); `vram-plan check` gives the analytic estimate") from exc
    except MemoryError as exc:
        raise VramPlanError("this model is too large to build on fake tensors in this process's memory; "
                            "`vram-plan check` gives the analytic estimate") from exc
    model.train()  # GRPO generates and scores inside training_step, in train mode
    return model


def _with_adapters(model: Any, train: TrainingConfig) -> Any:
    """The LoRA adapters over the model as the release's GRPOTrainer puts them there, a 4-bit model as the release
    sets it up (TrlRelease.qlora_setup)."""
    qlora_setup = train.release.qlora_setup if train.load_in_4bit else None
    if qlora_setup == "prepare_kbit_training":
        from peft import prepare_model_for_kbit_training

        # its checkpointing and input-gradient hook are the phases' (set_checkpointing, input_grads)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = _add_lora(model, train)
    if qlora_setup == "prepare_kbit_training" and train.mixed_precision == "bf16":
        _peft_module_casting_to_bf16(model)
    if qlora_setup == "bf16_adapters":
        _adapters_to_bf16(model)
    return model


def _add_lora(model: Any, train: TrainingConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    r = train.lora_r or 0
    config = LoraConfig(r=r, lora_alpha=train.lora_alpha or 2 * r, lora_dropout=train.lora_dropout,
                        target_modules=train.lora_targets or "all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)  # adapters upcast to fp32 (autocast_adapter_dtype=True), as in TRL


def _on_fake_tensors(model: Any, fake_mode: Any) -> Any:
    """Replace every meta tensor of `model` (parameters, buffers, tensor attributes) by a fake CPU tensor, but 4-bit
    weights, which `_loaded_in_4bit` quantizes."""
    made: dict[int, Any] = {}

    def fake(t: torch.Tensor) -> Any:
        if _is_4bit_weight(t):
            return t
        if id(t) not in made:
            with fake_mode:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            made[id(t)] = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)
        for name, value in vars(module).items():  # e.g. rotary embeddings' original_inv_freq
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(module, name, fake(value))
    return model


def _loaded_in_4bit(model: Any, session: Session, checkpoint_dtype: torch.dtype) -> Any:
    """`_on_fake_tensors` for a model quantized on load, its allocations and frees counted as the GPU sees them.

    transformers quantizes on the card (bitsandbytes' `Params4bit._quantize`): each checkpoint weight of a 4-bit
    layer is put there in `checkpoint_dtype`, `quantize_4bit` makes the packed weight and its state from it (and frees
    its float32 absmax once double quantization has packed it), and the checkpoint weight is freed before the next
    one comes. The weights come in the checkpoint's key order (transformers 5: `core_model_loading`, keys sorted by
    `dot_natural_key`, loaded one at a time when quantizing on the fly; 4.x: the shards' sorted keys, the same order
    but for the layers' numbers, which changes nothing here as every layer is alike), the LM head and the embedding
    first; PEFT's adapters come after the whole model. So the freed 16-bit blocks lie among the packed weights cut
    from them, which the step's requests find."""
    model = _on_fake_tensors(model, session.fake_mode)
    layer_of = {id(module): index for index, layer in enumerate(decoder_layers(model)) for module in layer.modules()}
    tracker = session.tracker
    for _, module, key in sorted(_base_parameter_slots(model), key=lambda slot: _natural_key(slot[0])):
        tracker.layer = layer_of.get(id(module), -1)
        t = module._parameters[key]
        if _is_4bit_weight(t):  # a bitsandbytes Linear4bit's
            module._parameters[key] = _quantized_on_fake_tensors(t, session.fake_mode, checkpoint_dtype, tracker)
            module.quant_state = module.weight.quant_state
            module.support_avx512bf16_for_cpu = False  # its CPU-only inference repacking, which CUDA never runs
        else:
            tracker.track(t)
    tracker.layer = -1
    return model


def _base_parameter_slots(model: Any) -> list[tuple[str, Any, str]]:
    """(checkpoint name, module, name in the module) of every parameter of the model under PEFT's wrapper but the
    adapters' (a tied weight once)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    slots, seen = [], set()
    for module_name, module in base.named_modules():
        for key, t in module._parameters.items():
            if t is None or id(t) in seen or "lora_" in module_name:
                continue
            seen.add(id(t))
            name = f"{module_name}.{key}".replace(".base_layer", "")
            slots.append((name, module, key))
    return slots


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    """transformers' `dot_natural_key`: a name's parts, numbers as numbers, sorting before words."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]


def _quantize_on_load(model: Any, train: TrainingConfig) -> None:
    """What `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` does to the model's skeleton, by
    transformers' own quantizer: its linear layers, but the output embedding and what the model keeps in float32,
    become bitsandbytes Linear4bit (quantized when their weights are loaded: `_quantized_on_fake_tensors`), and the
    model is marked loaded in 4 bits, which PEFT reads to wrap them in its 4-bit LoRA layers."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    from vram_planner.model.grpo_config import quantization_config_kwargs

    quantizer = AutoHfQuantizer.from_config(BitsAndBytesConfig(**quantization_config_kwargs(train)),
                                            pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None)
    quantizer.postprocess_model(model)


def _adapters_to_bf16(model: Any) -> None:
    """GRPOTrainer.__init__'s QLoRA cast (TRL 0.26 on; grpo_trainer.py 1.16.0:538-541): over a quantized model every
    trainable parameter but DoRA's magnitude vector goes to bfloat16, whatever the mixed precision. Before 0.26 the
    adapters stay as PEFT makes them, float32 (TrlRelease.qlora_setup)."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def _peft_module_casting_to_bf16(model: Any) -> None:
    """TRL 0.22-0.25's cast after PEFT's prepare_model_for_kbit_training under bf16 (trl/models/utils.py 0.22.0-0.25.0
    `peft_module_casting_to_bf16`, gone from the releases after), written out as those releases run it: a module
    named like a norm to float32, the embedding and the LM head back to bfloat16."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
            module.to(torch.float32)
        elif any(x in name for x in ["lm_head", "embed_tokens", "wte", "wpe"]):
            if hasattr(module, "weight") and module.weight.dtype == torch.float32:
                module.to(torch.bfloat16)


def _is_4bit_weight(t: torch.Tensor) -> bool:
    return type(t).__name__ == "Params4bit" and not getattr(t, "bnb_quantized", True)


def _quantized_on_fake_tensors(weight: Any, fake_mode: Any, dtype: torch.dtype, tracker: LiveBytes) -> Any:
    """A Linear4bit's weight as bitsandbytes leaves it on the GPU: `quantize_4bit` of the `dtype` checkpoint's weight,
    run on fake tensors (the packed uint8 weight, and the quantization state that keeps the absmax, the code and,
    double-quantized, the absmax's own state). A fake tensor cannot be a Params4bit (a tensor subclass of its own):
    the packed weight is a Parameter carrying the state, which Linear4bit reads first
    (`fix_4bit_weight_quant_state_from_module`). The `tracker` counts what it allocates and frees."""
    import bitsandbytes.functional as bnb_functional

    # Made from Python lists, which fake tensors cannot give: once, outside the fake world, as bitsandbytes caches it
    bnb_functional.name2qmap.setdefault("dynamic", bnb_functional.create_dynamic_map())
    with fake_mode, tracker:
        checkpoint_weight = torch.empty(weight.shape, dtype=dtype, device="cpu")
        packed, state = bnb_functional.quantize_4bit(
            checkpoint_weight, blocksize=weight.blocksize, compress_statistics=weight.compress_statistics,
            quant_type=weight.quant_type, quant_storage=weight.quant_storage)
    parameter = torch.nn.Parameter(packed, requires_grad=False)
    parameter.quant_state = state
    return parameter


def _add_fused_head(model: Any, outputs: tuple[str, ...], cast_lm_head_to_fp32: bool) -> None:
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)


def _cast_lm_head_to_fp32(target_model: Any) -> None:
    """TRL's own cast, which is a closure inside GRPOTrainer.__init__ (grpo_trainer.py 1.16.0:1014-1043, the same
    since 1.10), so it is written out here as the release runs it: the head module goes to float32 in place (a tied
    embedding's weight with it: the two share one Parameter), its forward becomes a float32 linear, and a tied
    embedding's output is cast back to the weights' dtype. Like TRL it reaches the embedding as
    `target_model.model.embed_tokens`, which a PEFT wrapper or a multimodal model does not have (TRL fails there too;
    verdict.cast_lm_head_arch_problems refuses those before any engine runs)."""
    original_dtype = target_model.lm_head.weight.dtype
    lm_head = target_model.lm_head.float()
    target_model.lm_head = lm_head

    def cast_forward_to_fp32(hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden_states.to(torch.float32), lm_head.weight.to(torch.float32),
                                          None if lm_head.bias is None else lm_head.bias.to(torch.float32))

    lm_head.forward = cast_forward_to_fp32
    if target_model.config.tie_word_embeddings:
        def cast_outputs_to_original_dtype(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            return output.to(original_dtype)

        target_model.model.embed_tokens.register_forward_hook(cast_outputs_to_original_dtype)


def set_checkpointing(model: Any, enabled: bool, reentrant: bool = False) -> None:
    """Gradient checkpointing as transformers' Trainer turns it on: every layer, reentrant or not as the release runs it
    (TrainingConfig.reentrant_checkpointing)."""
    if enabled:
        kwargs = {"use_reentrant": reentrant}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


@contextlib.contextmanager
def input_grads(session: Session) -> Iterator[None]:
    """TRL's `model.enable_input_require_grads()` where the release calls it, under LoRA and gradient checkpointing
    (TrainingConfig.first_layer_input_needs_grad): a forward hook that makes the embedding's output require grad, so
    the first layer's checkpoint recomputes with an input that needs a gradient and the output gets one at the end
    of the backward. TRL keeps it for the whole run; outside the loss (no_grad) it changes nothing, so it is taken
    off on exit. transformers 5's activation_checkpointing_enable adds one of its own for every text model."""
    train, model = session.train, session.model
    if not (train.uses_lora and train.gradient_checkpointing and train.first_layer_input_needs_grad):
        yield
        return
    embedding = session.base_model.get_input_embeddings()
    before = set(embedding._forward_hooks)
    model.enable_input_require_grads()
    ours = [key for key in embedding._forward_hooks if key not in before]
    try:
        yield
    finally:
        for table in (embedding._forward_hooks, embedding._forward_hooks_with_kwargs,
                      embedding._forward_hooks_always_called):
            for key in ours:
                table.pop(key, None)
