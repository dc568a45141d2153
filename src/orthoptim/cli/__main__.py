"""``python -m orthoptim.cli`` (and ``torchrun -m orthoptim.cli train ...``): the `orthoptim` command."""

from orthoptim.cli import console

console()
