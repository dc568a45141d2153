"""The execution plan: which matrices are processed together (megabatches) and, distributed,
how the work is shared and communicated."""

from orthoptim.distributed.comm import CommStats
from orthoptim.distributed.data_parallel import split_batch
from orthoptim.distributed.megabatch import megabatches
from orthoptim.distributed.mesh import resolve_process_group

__all__ = ["CommStats", "megabatches", "resolve_process_group", "split_batch"]
