"""``python -m orthoptim.cli`` (and ``torchrun -m orthoptim.cli train ...``): the `orthoptim` command."""

from orthoptim.cli import console

if __name__ == "__main__":  # importing the module (doctest collection, spawned processes) runs nothing
    console()
