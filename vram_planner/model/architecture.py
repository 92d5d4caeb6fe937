"""Decoder architectures as data: the facts of a config.json that memory depends on.

Parameter counts follow the modeling code of transformers 5.x for each family (the tests build every
catalog model on the meta device and compare, exactly).

What is planned: the model_types of FAMILIES (and their aliases), exactly. A config with another model_type is read
as a Llama-style decoder, with a note that counts may be off, only when it says it is a dense causal LM: an
`architectures` entry ending in ForCausalLM (or, for a multimodal wrapper, ForConditionalGeneration), no
`is_encoder_decoder`, no experts. Most new decoders are Llama-shaped, so that reading is close; an encoder or an
encoder-decoder cannot generate GRPO's completions, and a mixture of experts would be counted several times too
small, so those are refused, with the supported model_types in the message. Every size must be a positive integer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from vram_planner.errors import ProfileError, json_kind


@dataclass(frozen=True)
class Linear:
    """One nn.Linear inside a decoder layer."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class Family:
    """How a model_type lays out its decoder layer."""

    fused_qkv: bool = False  # phi3: one qkv_proj
    fused_gate_up: bool = False  # phi3: one gate_up_proj (mlp_names then names it and down_proj)
    gated_mlp: bool = True  # SwiGLU/GeGLU (gate, up, down) vs fc1/fc2
    qkv_bias: bool | None = None  # None: read `attention_bias`
    o_bias: bool | None = None  # None: same as the q/k/v bias
    norms_per_layer: int = 2
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma3)
    partial_rotary: bool = False  # phi: q and k leave rotary as one concatenated, already contiguous tensor
    layer_norm_bias: bool = False  # LayerNorm (weight and bias) instead of RMSNorm
    lm_head_bias: bool = False
    fp32_norm_scale: bool = False  # Gemma's RMSNorm scales by (1 + weight) in fp32 and casts back at the end
    attention_out_name: str = "o_proj"
    mlp_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    # the modeling code decorates its RMSNorm class with use_kernel_forward_from_hub("RMSNorm") and its
    # apply_rotary_pos_emb with use_kernel_forward_from_hub("rotary_pos_emb"): what the Hub's kernels replace where
    # transformers kernelizes (profiles/transformers.toml hub_kernels)
    hub_rms_norm: bool = True
    hub_rotary: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(qkv_bias=False),
    "qwen2": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm=True),
    "gemma": Family(fp32_norm_scale=True, hub_rms_norm=False),
    "gemma2": Family(norms_per_layer=4, fp32_norm_scale=True, hub_rms_norm=False),
    "gemma3_text": Family(norms_per_layer=4, qk_norm=True, fp32_norm_scale=True, hub_rms_norm=False),
    "phi3": Family(fused_qkv=True, fused_gate_up=True, qkv_bias=False, mlp_names=("gate_up_proj", "down_proj"),
                   hub_rotary=False),
    "phi": Family(
        gated_mlp=False, qkv_bias=True, norms_per_layer=1, layer_norm_bias=True, lm_head_bias=True, partial_rotary=True,
        attention_out_name="dense", mlp_names=("fc1", "fc2"), hub_rms_norm=False,
    ),
}
# Configs whose text model is one of the families above.
MODEL_TYPE_ALIASES = {"smollm2": "llama", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class ModelArchitecture:
    """A decoder-only transformer, reduced to what its memory depends on."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    family: Family = field(repr=False)
    exact: bool = True  # False when the model_type is unknown and read as Llama-style
    max_position_embeddings: int | None = None
    context_length: int | None = None  # the max_model_len vLLM derives from the config (vram_planner/model/vllm.py)
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many layers keep only `sliding_window` tokens of KV cache
    config_dtype: str | None = None
    mlp_bias: bool = False
    vision_params: int = 0  # a multimodal model's vision tower and projector (idle in text-only GRPO)
    hidden_act: str = "silu"  # the MLP's activation, as ACT2FN names it (what it keeps for backward)
    attn_logit_softcapping: float | None = None  # Gemma 2: tanh softcapping of the attention scores (eager only)
    resid_dropout: float = 0.0  # phi: dropout on the attention's and the MLP's outputs (resid_pdrop)
    name: str = ""
    hub_id: str = ""  # what to pass to from_pretrained / GRPOTrainer(model=...)

    @classmethod
    def from_config(cls, config: Any, name: str = "", hub_id: str = "") -> ModelArchitecture:
        """Read a transformers config.json dict (multimodal configs: their text_config); ProfileError when it is not
        a decoder language model's config or a size is not a positive integer."""
        where = f"model config {name or '(unnamed)'}"
        if not isinstance(config, dict):
            raise ProfileError(f"{where} should be a JSON object of settings (got a JSON {json_kind(config)})")
        vision_params, vision_known = 0, True
        if "text_config" in config and "hidden_size" not in config:
            vision_params, vision_known = _vision_params(config, where)
            config = _text_config(config, where)
        model_type = config.get("model_type", "")
        if not isinstance(model_type, str):
            raise ProfileError(f"{where}: model_type should be a string (got {model_type!r})")
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
        family = FAMILIES.get(model_type)
        if family is None:
            _refuse_unless_causal_decoder(config, model_type, where)
        sizes = _sizes(config, where)
        hidden, heads, num_layers = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_hidden_layers"]
        kv_heads, head_dim = _key_value_heads_and_head_dim(sizes, where)
        sliding_window, sliding_layers = _sliding_layers(config, model_type, num_layers, where)
        default_tie = model_type in ("gemma", "gemma2", "gemma3_text")
        gated = (family or Family()).gated_mlp
        return cls(
            model_type=model_type,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=sizes["intermediate_size"] or sizes["n_inner"] or 4 * hidden,
            tie_word_embeddings=_flag(config, "tie_word_embeddings", default_tie, where),
            family=_with_config_biases(family or Family(), config, where),
            exact=family is not None and vision_known,
            max_position_embeddings=sizes["max_position_embeddings"],
            context_length=_context_length(config, sizes["max_position_embeddings"]),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            config_dtype=config.get("dtype") or config.get("torch_dtype"),
            # phi's fc1/fc2 always carry biases; gated MLPs only when the config asks
            mlp_bias=_flag(config, "mlp_bias", False, where) if gated else True,
            vision_params=vision_params,
            hidden_act=_hidden_act(config, model_type),
            attn_logit_softcapping=_softcapping(config, model_type, where),
            resid_dropout=_probability(config, "resid_pdrop", where) if model_type == "phi" else 0.0,
            name=name,
            hub_id=hub_id or name,
        )

    def layer_linears(self) -> list[Linear]:
        """The linear layers of one decoder layer, named as in the modeling code (LoRA targets)."""
        return list(self._layer_linears)

    # The sizes below are read millions of times by the step-time fit and by plan's search: computed once per
    # architecture (a frozen dataclass: its fields never change, so neither do they)
    @cached_property
    def _layer_linears(self) -> tuple[Linear, ...]:
        f, h, d = self.family, self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * d, self.num_kv_heads * d
        qkv_bias = bool(f.qkv_bias)
        o_bias = qkv_bias if f.o_bias is None else f.o_bias
        if f.fused_qkv:
            attention = [Linear("qkv_proj", h, q_out + 2 * kv_out, qkv_bias)]
        else:
            attention = [Linear("q_proj", h, q_out, qkv_bias), Linear("k_proj", h, kv_out, qkv_bias),
                         Linear("v_proj", h, kv_out, qkv_bias)]
        attention.append(Linear(f.attention_out_name, q_out, h, o_bias))
        i, mlp_bias = self.intermediate_size, self.mlp_bias
        if not f.gated_mlp:
            mlp = [Linear(f.mlp_names[0], h, i, mlp_bias), Linear(f.mlp_names[1], i, h, mlp_bias)]
        elif f.fused_gate_up:
            mlp = [Linear(f.mlp_names[0], h, 2 * i, mlp_bias), Linear(f.mlp_names[1], i, h, mlp_bias)]
        else:
            mlp = [Linear(f.mlp_names[0], h, i, mlp_bias), Linear(f.mlp_names[1], h, i, mlp_bias),
                   Linear(f.mlp_names[2], i, h, mlp_bias)]
        return (*attention, *mlp)

    @property
    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.family.layer_norm_bias else 1)

    @cached_property
    def layer_params(self) -> int:
        qk_norm = 2 * self.head_dim if self.family.qk_norm else 0
        return (sum(lin.params for lin in self._layer_linears)
                + self.family.norms_per_layer * self.norm_params + qk_norm)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        bias = self.vocab_size if self.family.lm_head_bias else 0
        return bias + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @cached_property
    def linear_params(self) -> int:
        """Parameters inside the decoder layers' linear layers (what 4-bit quantisation replaces)."""
        return self.num_layers * sum(lin.in_features * lin.out_features for lin in self._layer_linears)

    @cached_property
    def params(self) -> int:
        """Total unique parameters, tied weights counted once (as `model.parameters()` does)."""
        return (self.embedding_params + self.num_layers * self.layer_params + self.norm_params
                + self.lm_head_params + self.vision_params)

    def lora_params(self, rank: int, target_modules: list[str] | None) -> int:
        """Trainable LoRA parameters: rank x (in + out) per targeted linear (None: every linear)."""
        per_layer = sum(rank * (lin.in_features + lin.out_features) for lin in self.lora_linears(target_modules))
        return per_layer * self.num_layers

    def lora_linears(self, target_modules: list[str] | None) -> list[Linear]:
        """The linear layers of one decoder layer that LoRA adapts (None or all-linear: every one)."""
        linears = self.layer_linears()
        if target_modules is None or target_modules == ["all-linear"]:
            return linears
        return [lin for lin in linears if lin.name in target_modules]

    def resolve_lora_targets(self, target_modules: list[str] | None) -> set[str]:
        return {lin.name for lin in self.lora_linears(target_modules)}

    @property
    def attention_mask_kinds(self) -> int:
        """How many [B, 1, L, L] masks a forward builds that some layer reads: a full-attention one and a sliding one
        where layers of both kinds exist (Gemma 2 and 3), else one."""
        return 2 if 0 < self.sliding_layers < self.num_layers else 1

    def kv_layers_tokens(self, sequence_tokens: int, sliding_keep_all: bool = False) -> int:
        """Sum over layers of the tokens each layer keeps in its KV cache for one sequence (`sliding_keep_all`:
        sliding-window layers hold every token too, as after a prefill of transformers 4.56 on)."""
        full = self.num_layers - self.sliding_layers
        window = sequence_tokens if sliding_keep_all else min(sequence_tokens, self.sliding_window or sequence_tokens)
        return full * sequence_tokens + self.sliding_layers * window


# Sizes are tensor dimensions; past int32 they are typos, and far past it the arithmetic leaves float range.
MAX_SIZE = 2**31 - 1
REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings")
# A config carrying one of these with more than one expert routes tokens through several MLPs: read as a dense
# Llama, its weights would be counted several times too small.
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def supported_model_types() -> list[str]:
    """The model_type values vram-plan models exactly (for messages)."""
    return sorted({*FAMILIES, *MODEL_TYPE_ALIASES})


def _context_length(config: dict[str, Any], max_positions: int | None) -> int | None:
    """The context vLLM takes when max_model_len is not given (vllm/config/model.py _get_and_verify_max_len, vLLM
    0.22-0.31): max_position_embeddings, times the RoPE scaling factor except for llama3/su/longrope (and Gemma 3,
    whose figure is already scaled); yarn scales original_max_position_embeddings; longrope defaults to
    original_max_position_embeddings."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if max_positions is None or not isinstance(rope, dict) or config.get("model_type", "").startswith("gemma3"):
        return max_positions
    kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
    original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if kind == "longrope":
        return original if _positive_int(original) else max_positions
    if kind in ("su", "llama3", "default", None) or not isinstance(factor, (int, float)) or factor <= 0:
        return max_positions
    base = original if kind == "yarn" and _positive_int(original) else max_positions
    return min(int(base * factor), MAX_SIZE)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE


def _sizes(config: dict[str, Any], where: str, required: tuple[str, ...] = REQUIRED_SIZES,
           optional: tuple[str, ...] = OPTIONAL_SIZES) -> dict[str, int | None]:
    """The sizes memory depends on, each a positive integer (or absent, for the optional ones)."""
    missing = [k for k in required if config.get(k) is None]
    if missing:
        hint = ": is it a decoder language model's config.json?" if required == REQUIRED_SIZES else ""
        raise ProfileError(f"{where} lacks {', '.join(missing)}{hint}")
    sizes = {k: config.get(k) for k in required + optional}
    for key, value in sizes.items():
        if value is not None and not _positive_int(value):
            raise ProfileError(f"{where}: {key} should be a positive integer (got {value!r})")
    return sizes


def _key_value_heads_and_head_dim(sizes: dict[str, int | None], where: str) -> tuple[int, int]:
    """Key/value heads that divide the query heads evenly (transformers' repeat_kv), and a head of at least one."""
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = sizes["num_key_value_heads"] or heads
    if heads % kv_heads:
        raise ProfileError(f"{where}: num_attention_heads ({heads}) should be a multiple of num_key_value_heads "
                           f"({kv_heads})")
    head_dim = sizes["head_dim"] or hidden // heads
    if not head_dim:
        raise ProfileError(f"{where}: hidden_size ({hidden}) is smaller than num_attention_heads ({heads}) and no "
                           "head_dim is given")
    return kv_heads, head_dim


def _flag(config: dict[str, Any], key: str, default: bool, where: str) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProfileError(f"{where}: {key} should be true or false (got {value!r})")
    return value


def _text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A multimodal config's text model settings, with the wrapper's tied embeddings and architectures."""
    text = config["text_config"]
    if not isinstance(text, dict):
        raise ProfileError(f"{where}: text_config should be a mapping of the text model's settings "
                           f"(got a JSON {json_kind(text)})")
    tie = config.get("tie_word_embeddings")
    return {**text, "architectures": text.get("architectures") or config.get("architectures"),
            "tie_word_embeddings": text.get("tie_word_embeddings", True) if tie is None else tie}


def _refuse_unless_causal_decoder(config: dict[str, Any], model_type: str, where: str) -> None:
    """An unknown model_type is read as a Llama-style decoder only when its config says it is a dense causal LM."""
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    # a multimodal wrapper names its generation head ...ForConditionalGeneration; encoder-decoders say so below
    causal = [n for n in names if n.endswith(("ForCausalLM", "ForConditionalGeneration"))]
    experts = [(k, config[k]) for k in EXPERT_COUNTS if isinstance(config.get(k), int) and config[k] > 1]
    label = f"model_type {model_type!r}" if model_type else "a config without model_type"
    if config.get("is_encoder_decoder") is True:
        problem = f"{label} is an encoder-decoder model"
    elif names and not causal:
        problem = f"{label} ({', '.join(names)}) is not a decoder language model"
    elif not causal:
        problem = f"{label} is not one vram-plan knows, and the config names no ...ForCausalLM architecture"
    elif experts:
        problem = f"{label} is a mixture-of-experts model ({experts[0][0]} {experts[0][1]})"
    else:
        return
    raise ProfileError(f"{where}: {problem}; vram-plan plans dense decoder-only language models: model_type "
                       f"{', '.join(supported_model_types())}, or another ...ForCausalLM read as Llama-style")


def _vision_params(config: dict[str, Any], where: str) -> tuple[int, bool]:
    """Parameters of a SigLIP vision tower and Gemma 3's projector (modeling_siglip, modeling_gemma3)."""
    vision = config.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ProfileError(f"{where}: vision_config should be a mapping (got a JSON {json_kind(vision)})")
    if not vision:
        return 0, True
    if vision.get("model_type") != "siglip_vision_model":
        return 0, False
    sizes = _sizes(vision, f"{where}: vision_config", ("hidden_size", "intermediate_size", "num_hidden_layers"),
                   ("patch_size", "num_channels", "image_size"))
    h, i, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    patch, channels, image = sizes["patch_size"] or 14, sizes["num_channels"] or 3, sizes["image_size"] or 224
    patches = (image // patch) ** 2
    embeddings = h * channels * patch * patch + h + patches * h
    per_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h  # q, k, v, out; fc1, fc2; two LayerNorms
    tower = embeddings + layers * per_layer + 2 * h  # post_layernorm
    text_hidden = config["text_config"].get("hidden_size") if isinstance(config["text_config"], dict) else None
    projector = h * text_hidden + h if config.get("model_type") == "gemma3" and _positive_int(text_hidden) else 0
    return tower + projector, True


# The default activation of each family's config class (transformers 5), where the config may leave it out.
DEFAULT_HIDDEN_ACT = {"phi": "gelu_new", "gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh",
                      "gemma3_text": "gelu_pytorch_tanh"}


def _hidden_act(config: dict[str, Any], model_type: str) -> str:
    """The MLP's activation as the modeling code reads it: Gemma 2 and 3's `hidden_activation`, else `hidden_act`."""
    keys = ("hidden_activation", "hidden_act") if model_type in ("gemma2", "gemma3_text") else ("hidden_act",)
    for key in keys:
        if isinstance(config.get(key), str):
            return config[key]
    return DEFAULT_HIDDEN_ACT.get(model_type, "silu")


def _softcapping(config: dict[str, Any], model_type: str, where: str) -> float | None:
    """Gemma 2's attn_logit_softcapping (its config's default 50.0 when left out; null turns it off); Gemma 3 has the
    setting but no default; other families have none."""
    if model_type not in ("gemma2", "gemma3_text"):
        return None
    value = config.get("attn_logit_softcapping", 50.0 if model_type == "gemma2" else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ProfileError(f"{where}: attn_logit_softcapping should be a positive number or null (got {value!r})")
    return float(value)


def _probability(config: dict[str, Any], key: str, where: str) -> float:
    value = config.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ProfileError(f"{where}: {key} should be a number from 0 up to 1 (got {value!r})")
    return float(value)


def _with_config_biases(family: Family, config: dict[str, Any], where: str) -> Family:
    if family.qkv_bias is not None:
        return family
    from dataclasses import replace

    return replace(family, qkv_bias=_flag(config, "attention_bias", False, where))


def _sliding_layers(config: dict[str, Any], model_type: str, num_layers: int,
                    where: str) -> tuple[int | None, int]:
    """The sliding window and how many layers use it (counted, never looped over: num_layers may be huge)."""
    window = config.get("sliding_window")
    if not window or _flag(config, "use_sliding_window", True, where) is False:
        return None, 0
    if not _positive_int(window):
        raise ProfileError(f"{where}: sliding_window should be a positive integer (got {window!r})")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return window, sum(1 for t in layer_types[:num_layers] if t == "sliding_attention")
    if model_type == "gemma2":  # every other layer, starting with the first
        return window, num_layers - num_layers // 2
    if model_type == "gemma3_text":  # all but every `pattern`-th layer
        pattern = _sizes(config, where, (), ("sliding_window_pattern",))["sliding_window_pattern"] or 6
        return window, num_layers - num_layers // pattern
    if model_type in ("mistral", "phi3"):  # transformers' DynamicCache slides every layer of a config with a window
        return window, num_layers
    return None, 0
