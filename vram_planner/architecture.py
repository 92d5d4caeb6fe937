"""Decoder architectures as data: the facts of a config.json that memory depends on.

Parameter counts follow the modeling code of transformers 5.x for each family (the tests build every
catalog model on the meta device and compare, exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vram_planner.errors import ProfileError


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
    fused_gate_up: bool = False  # phi3: one gate_up_proj
    gated_mlp: bool = True  # SwiGLU/GeGLU (gate, up, down) vs fc1/fc2
    qkv_bias: bool | None = None  # None: read `attention_bias`
    o_bias: bool | None = None  # None: same as the q/k/v bias
    norms_per_layer: int = 2
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma3)
    layer_norm_bias: bool = False  # LayerNorm (weight and bias) instead of RMSNorm
    lm_head_bias: bool = False
    fp32_norm_scale: bool = False  # Gemma's RMSNorm scales by (1 + weight) in fp32 and casts back at the end
    attention_out_name: str = "o_proj"
    mlp_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(qkv_bias=False),
    "qwen2": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm=True),
    "gemma": Family(fp32_norm_scale=True),
    "gemma2": Family(norms_per_layer=4, fp32_norm_scale=True),
    "gemma3_text": Family(norms_per_layer=4, qk_norm=True, fp32_norm_scale=True),
    "phi3": Family(fused_qkv=True, fused_gate_up=True, qkv_bias=False),
    "phi": Family(
        gated_mlp=False, qkv_bias=True, norms_per_layer=1, layer_norm_bias=True, lm_head_bias=True,
        attention_out_name="dense", mlp_names=("fc1", "fc2"),
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
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many layers keep only `sliding_window` tokens of KV cache
    config_dtype: str | None = None
    mlp_bias: bool = False
    vision_params: int = 0  # a multimodal model's vision tower and projector (idle in text-only GRPO)
    name: str = ""
    hub_id: str = ""  # what to pass to from_pretrained / GRPOTrainer(model=...)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "", hub_id: str = "") -> ModelArchitecture:
        """Read a transformers config.json dict (multimodal configs: their text_config)."""
        vision_params, vision_known = 0, True
        if "text_config" in config and "hidden_size" not in config:
            vision_params, vision_known = _vision_params(config)
            config = {**config["text_config"], "tie_word_embeddings": config.get(
                "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", True))}
        model_type = str(config.get("model_type", ""))
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
        family = FAMILIES.get(model_type)
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(config.get(k), int)]
        if missing:
            raise ProfileError(f"model config {name or '(unnamed)'} lacks {', '.join(missing)}: "
                               "is it a decoder language model's config.json?")
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        num_layers = config["num_hidden_layers"]
        intermediate = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
        sliding_window, sliding_layers = _sliding_layers(config, model_type, num_layers)
        default_tie = model_type in ("gemma", "gemma2", "gemma3_text")
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", default_tie)),
            family=_with_config_biases(family or Family(), config),
            exact=family is not None and vision_known,
            max_position_embeddings=config.get("max_position_embeddings"),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            config_dtype=config.get("dtype") or config.get("torch_dtype"),
            # phi's fc1/fc2 always carry biases; gated MLPs only when the config asks
            mlp_bias=bool(config.get("mlp_bias", False)) if (family or Family()).gated_mlp else True,
            vision_params=vision_params,
            name=name,
            hub_id=hub_id or name,
        )

    def layer_linears(self) -> list[Linear]:
        """The linear layers of one decoder layer, named as in the modeling code (LoRA targets)."""
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
            mlp = [Linear("gate_up_proj", h, 2 * i, mlp_bias), Linear("down_proj", i, h, mlp_bias)]
        else:
            mlp = [Linear("gate_proj", h, i, mlp_bias), Linear("up_proj", h, i, mlp_bias),
                   Linear("down_proj", i, h, mlp_bias)]
        return attention + mlp

    @property
    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.family.layer_norm_bias else 1)

    @property
    def layer_params(self) -> int:
        qk_norm = 2 * self.head_dim if self.family.qk_norm else 0
        return (sum(lin.params for lin in self.layer_linears())
                + self.family.norms_per_layer * self.norm_params + qk_norm)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        bias = self.vocab_size if self.family.lm_head_bias else 0
        return bias + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def linear_params(self) -> int:
        """Parameters inside the decoder layers' linear layers (what 4-bit quantisation replaces)."""
        return self.num_layers * sum(lin.in_features * lin.out_features for lin in self.layer_linears())

    @property
    def params(self) -> int:
        """Total unique parameters, tied weights counted once (as `model.parameters()` does)."""
        return (self.embedding_params + self.num_layers * self.layer_params + self.norm_params
                + self.lm_head_params + self.vision_params)

    def lora_params(self, rank: int, target_modules: list[str] | None) -> int:
        """Trainable LoRA parameters: rank x (in + out) per targeted linear (None: every linear)."""
        targets = self.resolve_lora_targets(target_modules)
        per_layer = sum(rank * (lin.in_features + lin.out_features)
                        for lin in self.layer_linears() if lin.name in targets)
        return per_layer * self.num_layers

    def resolve_lora_targets(self, target_modules: list[str] | None) -> set[str]:
        names = {lin.name for lin in self.layer_linears()}
        if target_modules is None or target_modules == ["all-linear"]:
            return names
        return {t for t in target_modules if t in names}

    def kv_layers_tokens(self, sequence_tokens: int) -> int:
        """Sum over layers of the tokens each layer keeps in its KV cache for one sequence."""
        full = self.num_layers - self.sliding_layers
        window = min(sequence_tokens, self.sliding_window or sequence_tokens)
        return full * sequence_tokens + self.sliding_layers * window


def _vision_params(config: dict[str, Any]) -> tuple[int, bool]:
    """Parameters of a SigLIP vision tower and Gemma 3's projector (modeling_siglip, modeling_gemma3)."""
    vision = config.get("vision_config") or {}
    if not vision:
        return 0, True
    if vision.get("model_type") != "siglip_vision_model":
        return 0, False
    h, i, layers = vision["hidden_size"], vision["intermediate_size"], vision["num_hidden_layers"]
    patch, channels = vision.get("patch_size", 14), vision.get("num_channels", 3)
    patches = (vision.get("image_size", 224) // patch) ** 2
    embeddings = h * channels * patch * patch + h + patches * h
    per_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h  # q, k, v, out; fc1, fc2; two LayerNorms
    tower = embeddings + layers * per_layer + 2 * h  # post_layernorm
    projector = h * config["text_config"]["hidden_size"] + h if config.get("model_type") == "gemma3" else 0
    return tower + projector, True


def _with_config_biases(family: Family, config: dict[str, Any]) -> Family:
    if family.qkv_bias is not None:
        return family
    from dataclasses import replace

    return replace(family, qkv_bias=bool(config.get("attention_bias", False)))


def _sliding_layers(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, int]:
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None, 0
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return window, sum(1 for t in layer_types if t == "sliding_attention")
    if model_type == "gemma2":
        return window, sum(1 for i in range(num_layers) if (i + 1) % 2)
    if model_type == "gemma3_text":
        pattern = config.get("sliding_window_pattern") or 6
        return window, sum(1 for i in range(num_layers) if (i + 1) % pattern)
    if model_type == "mistral":
        return window, num_layers
    return None, 0
