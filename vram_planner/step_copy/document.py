"""What a copy of a traced step keeps: the shallow model's stream outside the KV cache's growth, each request's size as
a polynomial in the prompt and completion lengths, and where the growth goes. Written by `make`, read back from the
user's cache (`store`), validated here. Pure Python.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

FORMAT = 1


class StepCopy(BaseModel):
    """One model's step under one set of knobs (the batch included), at any prompt and completion length the copy
    answers for (`lengths.refusal`) and any depth of the decoder's period."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: int = FORMAT
    windows: list[int | None]  # each layer's sliding window in the shallow model traced (None: full attention)
    unit: tuple[int, int]  # [start, stop) of the layers copied to make a deeper model (layers.copied_unit)
    lattice: list[tuple[int, int]]  # the (prompt, completion) lengths traced, the polynomials' base first
    # the completions the traced ones share the fused LM head's number of token tiles with (None: no fused head)
    completion_range: tuple[int, int] | None
    names: list[str]  # the phases' and moments' names the events index
    # the stream outside the cache growth, at the base lengths: (allocates, block, phase, moment, layer)
    events: list[tuple[bool, int, int, int, int]]
    next_block: int  # a block number no event of the traced stream uses
    growth_at: list[int]  # per run of cache growth, the index of the event it goes before
    # per run: (the blocks the prefill's cache storages hold, their bytes per prompt token, the blocks the traced
    # last step makes), keys then values, layer by layer (cache_growth's order); -1 where a layer has none
    regions: list[tuple[list[int], list[int], list[int]]]
    denominator: int
    coefficients: list[tuple[int, int, int, int, int, int]]  # per request, over `denominator`: 1, p, c, p², pc, c²
    per_added_token: list[int]  # per request, the bytes it grows by for each token the last decoding step adds past 1

    @model_validator(mode="after")
    def _consistent(self) -> StepCopy:
        requests = sum(allocates for allocates, *_ in self.events)
        if self.format != FORMAT:
            raise ValueError(f"a copy of format {self.format}, this version reads {FORMAT}")
        if len(self.coefficients) != requests or len(self.per_added_token) != requests:
            raise ValueError("a size for every request")
        if len(self.growth_at) != len(self.regions) or any(not 0 <= i <= len(self.events) for i in self.growth_at):
            raise ValueError("a place for every run of cache growth")
        if any(len(part) != 2 * len(self.windows) for region in self.regions for part in region):
            raise ValueError("two cache storages a layer in every run of cache growth")
        if not 0 <= self.unit[0] < self.unit[1] <= len(self.windows) or self.denominator < 1 or not self.lattice:
            raise ValueError("layers copied within the model, a positive denominator, lengths traced")
        if any(not 0 <= phase < len(self.names) or not 0 <= moment < len(self.names)
               for _, _, phase, moment, _ in self.events):
            raise ValueError("a name for every phase and moment")
        return self

    @property
    def layers(self) -> int:
        return len(self.windows)

    @property
    def period(self) -> int:
        return self.unit[1] - self.unit[0]
