"""The distributed kvstore this process trains with, for components that shard by rank.

A data loader needs this worker's rank and the number of workers, and those are only
known once the distributed kvstore has connected to the scheduler (kv.rank is assigned
by the scheduler; it is not DMLC_TASK_ID). Every distributed store mxhylo creates
records itself here; RecordLoader and ``python -m mxhylo.run`` read it.
"""
_ACTIVE = None


def set_active(kv):
    """Record ``kv`` (any MXNet KVStore or KVStoreBase) as this process's store."""
    global _ACTIVE
    _ACTIVE = kv


def active():
    """The recorded distributed store, or None when this process is not distributed."""
    return _ACTIVE
