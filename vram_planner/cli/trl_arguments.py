"""TRL's own command-line arguments on vram-plan's command line (vram_planner.trl_arguments parses them): split from
the command's own options before click parses those, and given to the command as a recipe's keys."""

from __future__ import annotations

from typing import Any

import click

from vram_planner.trl_arguments import split_trl_arguments


class TrlArgumentsCommand(click.Command):
    """A command that also takes TRL's command-line arguments: its callback gets them as `trl_arguments` (name ->
    value, in the order given; absent when there are none)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", "TRL's own arguments are read too, as TRL's parser reads them, e.g. "
                                    "--model_name_or_path Qwen/Qwen2.5-1.5B --use_peft --lora_r 16 --bf16 true "
                                    "(they win over a --config recipe's keys, and the options above over both), and "
                                    "the launcher's that trl grpo hands to accelerate, e.g. --num_processes 8 "
                                    "--accelerate_config zero3.")
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        known = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
        args, trainer_fsdp = _trainer_fsdp(args)
        ours, trl = split_trl_arguments(args, known)
        if trainer_fsdp is not None:
            trl["fsdp"] = trainer_fsdp
        rest = super().parse_args(ctx, ours)
        if trl:
            ctx.params["trl_arguments"] = trl
        return rest


def _trainer_fsdp(args: list[str]) -> tuple[list[str], str | None]:
    """TrainingArguments' `--fsdp "full_shard auto_wrap"` (the Trainer's FSDP options, a value after it), taken from
    the arguments so that vram-plan's --fsdp switch does not meet a value it has no place for; the recipe's reading
    says what the plan makes of it."""
    for i, token in enumerate(args[:-1]):
        if token == "--fsdp" and not args[i + 1].startswith("-"):
            return args[:i] + args[i + 2:], args[i + 1]
    return args, None
