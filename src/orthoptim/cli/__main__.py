"""``python -m orthoptim.cli`` (and ``torchrun -m orthoptim.cli train ...``): the `orthoptim` command."""

import sys

from orthoptim.cli import main

sys.exit(main())
