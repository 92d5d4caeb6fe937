import sys

from vram_planner.cli import main

exit_code = main()
from vram_planner.run.several import exit_rank, launched_worker  # noqa: E402  (after the answer: `--help` stays quick)

if launched_worker():  # one of the processes `run --num-gpus` launched: its exit skips the interpreter's teardown
    exit_rank(exit_code)
sys.exit(exit_code)
