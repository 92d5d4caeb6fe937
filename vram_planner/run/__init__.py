"""`vram-plan run`: start the GRPO run the plan recommends, with its data and reward checks."""
