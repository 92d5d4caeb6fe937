import sys

from vram_planner.cli import main

sys.exit(main())
