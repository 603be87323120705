"""The expert FFN on the CPU: row blocks of each expert run in parallel lanes, with buffers kept
from step to step. A backend of ``routing_kernels.expert_ffn`` (``cpu_blocks``), which
``routing_kernels.dispatch`` picks; nothing outside routing_kernels calls it, bar tests.

Two entry points, one implementation: ``expert_ffn(x_SD, counts, ...)`` on rows already in expert
order (expert parallelism, between the All-to-All exchanges), and ``routed_expert_ffn``, which
folds the permutation and the weighted combine into the same block loop (the local layer): the
inputs in expert order never exist as an [S, D] buffer.

- ``pool``: the large buffers, kept per set of expert weights (``BufferPool``, ``pool_for``).
- ``lanes``: the worker threads, the queue of row blocks they take (``BlockQueue``), the lane
  count policy (``lane_count``) and ``forced_schedule``, which fixes all of it for tests.
- ``blocks``: the hand-written forward and backward of one row block of one expert at a time.
- ``ops``: the entry points, and the custom ops torch.compile sees instead of the Python above.
"""

from .lanes import Block, BlockQueue, LaneFailed, ScheduleLog, forced_schedule, lane_count, release_lanes
from .ops import expert_ffn, routed_expert_ffn
from .pool import BufferPool, pool_for

__all__ = [
    "expert_ffn",
    "routed_expert_ffn",
    "forced_schedule",
    "ScheduleLog",
    "Block",
    "BlockQueue",
    "LaneFailed",
    "lane_count",
    "release_lanes",
    "BufferPool",
    "pool_for",
]
