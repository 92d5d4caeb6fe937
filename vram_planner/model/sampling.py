"""generate()'s sampling at a decoding step: the logits processors GRPOConfig's sampling knobs switch on, and the
tensors of the step's logits' size each one holds.

transformers' _get_logits_processor applies the repetition penalty, then the temperature, top-k, top-p and min-p
warpers, each returning a new float32 [rows, vocab] tensor that replaces the scores it got
(generation/logits_process.py, 5.24). generate() keeps its float32 copy of the logits throughout, and after the chain
come the softmax's probabilities and torch.multinomial's exponential noise (components.generation_logits_bytes). The
counts below are the trace's (tests/model/test_sampling_filters.py holds them to transformers' own processors).
"""

from __future__ import annotations

from vram_planner.model.spec import TrainingConfig

FP32_BYTES = 4
INT64_BYTES = 8
BOOL_BYTES = 1


def active_processors(train: TrainingConfig) -> list[str]:
    """The knobs whose processor generate() runs, in its order (each condition is _get_logits_processor's)."""
    active = []
    if train.repetition_penalty != 1.0:
        active.append("repetition_penalty")
    if train.sampling_temperature != 1.0:
        active.append("temperature")
    if train.sampling_top_k != 0:
        active.append("top_k")
    if train.top_p < 1.0:
        active.append("top_p")
    if train.min_p is not None:  # even 0 runs the warper
        active.append("min_p")
    return active


def processor_peak_bytes(name: str, train: TrainingConfig, rows: int, vocab: int, tokens: int) -> float:
    """The most one processor allocates at once over `rows` rows of `vocab` scores, its output included (its input,
    alive throughout, aside); `tokens`: the ids so far, which the repetition penalty gathers scores at."""
    scores = rows * vocab
    if name == "temperature":  # scores / temperature
        return scores * FP32_BYTES
    if name == "top_k":  # topk's values and indices; the values' last column compared into a mask; masked_fill
        k = min(train.sampling_top_k, vocab)
        return max(rows * k * (FP32_BYTES + INT64_BYTES), rows * k * FP32_BYTES + scores * BOOL_BYTES,
                   scores * (BOOL_BYTES + FP32_BYTES))
    if name == "top_p":  # sorted values and indices, the cumulative probabilities, two masks, the output
        return scores * (FP32_BYTES + INT64_BYTES + FP32_BYTES + 2 * BOOL_BYTES + FP32_BYTES)
    if name == "min_p":  # the probabilities, the mask, the output
        return scores * (FP32_BYTES + BOOL_BYTES + FP32_BYTES)
    if name == "repetition_penalty":
        # the scores padded by a column for out-of-vocabulary ids; the ids clamped, the gathered scores, their sign
        # mask, both penalised copies and the choice between them; then the scatter's padded output
        padded = rows * (vocab + 1) * FP32_BYTES
        gathered = rows * tokens
        return max(padded + gathered * (INT64_BYTES + FP32_BYTES + BOOL_BYTES + 3 * FP32_BYTES),
                   2 * padded + gathered * (INT64_BYTES + FP32_BYTES))
    raise ValueError(f"no logits processor for {name!r}")


def sampling_bytes(train: TrainingConfig, rows: int, vocab: int, tokens: int) -> float:
    """What sampling holds at once beside generate()'s float32 copy of the logits: the processors' tensors at the
    largest of their moments, or after them the last one's output, the probabilities and multinomial's noise."""
    scores = rows * vocab
    carried = peak = 0.0  # the previous processor's output: the first takes the copy itself
    for name in active_processors(train):
        peak = max(peak, carried + processor_peak_bytes(name, train, rows, vocab, tokens))
        # the repetition penalty's output is a view of its padded scatter
        carried = rows * (vocab + 1 if name == "repetition_penalty" else vocab) * FP32_BYTES
    return max(peak, carried + 2 * scores * FP32_BYTES)
