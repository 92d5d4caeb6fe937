"""The exact engine's copy: a traced step's allocations at other prompt and completion lengths and depths, made
without torch from a document of a shallow model's traces, and replayed through the allocator model.

`check --exact` traces one step (seconds to a minute, torch). Its stream keeps its shape as the lengths and the depth
change (benchmarks/stream_shape.py): the same requests in the same order, each of a size that is a polynomial of
degree two in the prompt and completion lengths, the KV cache's growth the concatenations
vram_planner.tracing.cache_growth makes, the layers a loop of the decoder's period. `make` (the torch side) traces a
shallow copy of the model at short lengths and writes the document (`document.StepCopy`); `lengths` and `layers` make
the step's stream from it at the lengths and depth asked, request for request the stream a trace there would give
(benchmarks/copy_at_boundary.py holds it to the boundary's hardest points); `replay` judges it.
"""
