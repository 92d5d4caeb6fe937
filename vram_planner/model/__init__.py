"""The analytic memory model: pure, torch-free; a GRPO step's memory phase by phase from a model and a config."""
