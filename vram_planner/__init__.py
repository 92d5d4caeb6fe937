"""vram-plan: plan the GPU memory of TRL GRPO fine-tuning runs."""

__version__ = "0.1.0"
