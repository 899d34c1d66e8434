import sys

from agents.sim.cli import main

sys.exit(main())
