"""``python -m orthoptim`` (and ``torchrun -m orthoptim train ...``): the `orthoptim` command, as
``python -m orthoptim.cli``."""

from orthoptim.cli import console

console()
