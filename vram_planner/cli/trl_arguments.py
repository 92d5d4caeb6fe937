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
                                    "(they win over a --config recipe's keys, and the options above over both).")
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        known = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
        ours, trl = split_trl_arguments(args, known)
        rest = super().parse_args(ctx, ours)
        if trl:
            ctx.params["trl_arguments"] = trl
        return rest
