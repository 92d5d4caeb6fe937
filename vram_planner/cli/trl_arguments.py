"""TRL's own command-line arguments on vram-plan's command line (vram_planner.trl_arguments parses them): split from
the command's own options before click parses those, and given to the command as a recipe's keys."""

from __future__ import annotations

import click

from vram_planner.trl_arguments import split_trl_arguments


class TrlArgumentsCommand(click.Command):
    """A command that also takes TRL's command-line arguments: its callback gets them as `trl_arguments` (name ->
    value, in the order given; absent when there are none)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        known = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
        ours, trl = split_trl_arguments(args, known)
        rest = super().parse_args(ctx, ours)
        if trl:
            ctx.params["trl_arguments"] = trl
        return rest
