"""What the benchmarks' adapters over one native MXNet store share: a KVStoreBase that
gluon.Trainer can take, whose Trainer updates on the workers (no optimizer goes to
the servers), and which reports the native store's type, rank and workers.
Subclasses set ``self._kv`` (an mx.kv store) and say how a key is broadcast and
pushpulled."""
from mxnet.kvstore import KVStoreBase


class WorkerUpdateStore(KVStoreBase):
    """Base of the adapters (see the module docstring)."""

    @staticmethod
    def is_capable(capability):
        return False        # the update runs on the workers

    def set_optimizer(self, optimizer):
        raise NotImplementedError("%s updates on the workers (update_on_kvstore=False)"
                                  % type(self).__name__)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError

    def load_optimizer_states(self, fname):
        raise NotImplementedError

    @property
    def type(self):
        return self._kv.type

    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers
