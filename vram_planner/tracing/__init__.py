"""The torch side of the trace engine: a live-bytes counter, the models on fake tensors, CUDA-like patches, phases.

Imported only inside `vram_planner.tracing.step.trace_step`, never by the planner, so torch at the top of these modules
costs the planner nothing. transformers, trl and peft are imported where they are used. `events` (the ordered
allocations and frees) and `reserve` (their replay through vram_planner.allocator) are pure Python.
"""
