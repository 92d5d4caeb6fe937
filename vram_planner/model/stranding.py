"""What the allocation patterns are made of: the rest a kept block leaves of the cached block best fit cut it from,
the largest block a layer asks for per token, and the optimizer states that strand segments. Shared by the loss's
patterns (vram_planner.model.fragmentation) and generation's (vram_planner.model.generation_patterns). Pure Python."""

from __future__ import annotations

from vram_planner.allocator.sizes import K_SMALL_SIZE
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import Optimizer, TrainingConfig


def stranded_by_kept_inputs(layers: int, input_bytes: int, projection_bytes: int) -> float:
    """What `layers` kept inputs of `input_bytes` strand in the freed segments of `projection_bytes` requests: per
    layer (projection - k x input) / k, k = projection // input. Exact where the sizes are whole granules of the
    allocator (512 bytes, 2 MiB segments) and k divides the layers; otherwise within a segment's rounding (the last
    segment, partly filled, strands more or less as later tensors fill it). Unrounded, so that it never falls as the
    tokens grow: the planner's searches rely on memory that grows with every knob."""
    if input_bytes <= K_SMALL_SIZE or projection_bytes < input_bytes:
        return 0.0
    sharing = projection_bytes // input_bytes
    return layers * (projection_bytes - sharing * input_bytes) / sharing


def largest_request_token_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """A token's share of the largest block a layer asks for: the MLP's intermediate activation in float32 where the
    output projection reads it so (a LoRA adapter on it is float32 and PEFT casts its input to it; a float32 model
    computes there), else in the compute dtype."""
    s = m.sizes(train)
    reads_intermediate = arch.layer_linears()[-1].name  # the MLP's output projection
    adapted = train.uses_lora and reads_intermediate in arch.resolve_lora_targets(train.lora_targets)
    in_float32 = adapted or s.residual == m.FP32_BYTES
    return arch.intermediate_size * (m.FP32_BYTES if in_float32 else s.compute)


def whole_large_states(train: TrainingConfig) -> bool:
    # LoRA's adapters' states are small, ZeRO's and FSDP's sharded; paged states live in managed memory, Adafactor's
    # are factored and SGD keeps none
    opt = train.optim
    return not (train.uses_lora or train.zero_stage is not None or train.fsdp or opt.is_paged
                or not opt.state_tensors)


def state_element_bytes(train: TrainingConfig) -> int:
    # bitsandbytes' 8-bit states are a byte an element, its 32-bit ones float32; torch's follow the parameter
    opt = train.optim
    return 1 if opt.is_8bit else m.FP32_BYTES if opt is Optimizer.lion_32bit else m.sizes(train).trainable
