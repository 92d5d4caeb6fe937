"""`python -m vram_planner.app [--host H] [--port P] [--allow-local-files | --no-allow-local-files]`: serve the page and
the API. `vram-plan app` starts this module in a process of its own, so that the command line never imports the web
app (nor the app the command line); bad input is one line and exit 2, as on the command line."""

from __future__ import annotations

import argparse
import sys

from vram_planner.errors import VramPlanError, one_line

EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vram-plan app", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--allow-local-files", action=argparse.BooleanOptionalAction, default=None)
    options = parser.parse_args(argv)
    from vram_planner.app.server import serve

    try:
        serve(options.host, options.port, options.allow_local_files)
    except VramPlanError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
