"""miles.buffers: the versioned replay buffer, its ledger and its policies.

``ReplayBuffer`` is a plain object (the runtime wraps it in a Ray actor in one place);
``Ledger`` is the accounting it reports; the policies and filters are small named
callables handed to the buffer's constructor.
"""

from miles.buffers.ledger import GroupLedger, Ledger, LedgerError
from miles.buffers.policies import (
    EvictionPolicy,
    GroupFilter,
    SamplingPolicy,
    drop_aborted,
    drop_truncated,
    drop_uniform_rewards,
    evict_fifo,
    evict_oldest,
    fifo,
    filter_name,
    oldest_first,
    priority,
)
from miles.buffers.records import Group
from miles.buffers.replay import STALE_POLICIES, BufferConfig, BufferFull, ReplayBuffer

__all__ = [
    "STALE_POLICIES",
    "BufferConfig",
    "BufferFull",
    "EvictionPolicy",
    "Group",
    "GroupFilter",
    "GroupLedger",
    "Ledger",
    "LedgerError",
    "ReplayBuffer",
    "SamplingPolicy",
    "drop_aborted",
    "drop_truncated",
    "drop_uniform_rewards",
    "evict_fifo",
    "evict_oldest",
    "fifo",
    "filter_name",
    "oldest_first",
    "priority",
]
