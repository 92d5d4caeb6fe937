"""`vram-plan probe`: measure GRPO steps on a GPU (or the trace engine) and fit the calibration."""
