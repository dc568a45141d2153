"""The execution plan: which matrices are processed together (megabatches), and, distributed,
how they are communicated. Single-process runs use only the megabatch planner."""

from orthoptim.distributed.megabatch import megabatches

__all__ = ["megabatches"]
