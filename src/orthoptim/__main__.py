"""``python -m orthoptim`` (and ``torchrun -m orthoptim train ...``): the `orthoptim` command, as
``python -m orthoptim.cli``."""

from orthoptim.cli import console

if __name__ == "__main__":  # importing the module (doctest collection, spawned processes) runs nothing
    console()
