"""The distributed kvstore this process trains with, for components that shard by rank.

A data loader needs this worker's rank and the number of workers, and those are only
known once the distributed kvstore has connected to the scheduler (kv.rank is assigned
by the scheduler; it is not DMLC_TASK_ID). Every distributed store mxhylo creates
records itself here; RecordLoader and ``python -m mxhylo.run`` read it.

The record is a weak reference: the store lives as long as the user's script holds it
(its Trainer). A strong one kept the store, and MXNet's native store inside it, until
this module was torn down at exit, after MXNet's own: the native store was then never
destroyed, and ps-lite's threads ended the worker with "terminate called without an
active exception".
"""
import weakref

_ACTIVE = None


def set_active(kv):
    """Record ``kv`` (any MXNet KVStore or KVStoreBase) as this process's store."""
    global _ACTIVE
    _ACTIVE = None if kv is None else weakref.ref(kv)


def active():
    """The recorded distributed store, or None when this process is not distributed
    (or its store is gone)."""
    return None if _ACTIVE is None else _ACTIVE()
