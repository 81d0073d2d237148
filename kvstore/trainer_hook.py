"""The explicit hook between Gluon's Trainer and a hylo store.

Gluon's Trainer hands its store one key per call (the parameter's index) and tells it
neither the parameter's name, nor the step's other keys, nor the optimizer. A hylo store
needs all three: names for the policy's regexes, stats() and errors; the whole step
at once (small layers fused, in the order backward writes them); the optimizer's
momentum (momentum correction). So, as Horovod's DistributedTrainer overrides ``_allreduce_grads``, this
hook replaces two methods of ``gluon.Trainer`` itself, for Trainers whose kvstore is
a hylo store, and leaves every other store to Gluon's own code:

* ``_init_kvstore``: once Gluon has created the Trainer's store, a hylo store is told
  its Trainer (``Hylo.attach_trainer``), before the parameters are broadcast under
  their indices; and it chooses where the Trainer's optimizer runs
  (``Hylo.route_for``): on the servers, the Trainer gets the store of that route
  (kvstore.server_route.ServerUpdateStore) with update_on_kvstore, and Gluon drives
  it as it drives dist_sync;
* ``_allreduce_grads``: a hylo store exchanges the whole step in one call
  (``Hylo.exchange_step``) instead of Gluon's loop of one pushpull per key; on the
  servers' route the Trainer's optimizer settings (its learning rate) reach the
  servers first (``ServerUpdateStore.sync_optimizer``), then Gluon's loop runs.

And one repair for every distributed store, MXNet's own included:

* ``_init_params``: waits until the parameters it broadcast have arrived. Why: in
  MXNet 1.9.1's KVStoreDist the broadcast's pull lands in a fresh buffer on every
  worker but rank 0, and the first step's pushpull of the same key uses the gradient
  array as its buffer: two engine operations with no variable in common, so ps-lite
  may send the pushpull first. When that push completes the server's round, the pull
  returns the summed gradient instead of the initial weights, and with
  update_on_kvstore=False that worker trains on different weights for good
  (measured: 1 run in 7 of a 2-worker dist_sync job on 2 loaded cores).

Patched on the class, so it covers ``gluon.Trainer(kvstore='dist_sync_hylo')`` built by
the user, mxhylo.LARSTrainer (a subclass) and the Trainers mxhylo.run gives the job's
store. Installed once, when mxhylo.kvstore is imported (as the store's names are
registered with MXNet).
"""
import functools
import os

from .server_route import ServerUpdateStore

_GLUON = {}      # method name -> Gluon's own function, once installed (install once)


def install(store_class):
    """Route Trainers whose kvstore is an instance of ``store_class`` through it.

    Not on a parameter server or scheduler: they train nothing, and a server imports
    mxhylo (for the pickled decoder) while MXNet itself is still being imported."""
    if _GLUON or os.environ.get("DMLC_ROLE") in ("server", "scheduler"):
        return
    from mxnet import gluon
    init_kvstore = gluon.Trainer._init_kvstore
    init_params = gluon.Trainer._init_params
    allreduce_grads = gluon.Trainer._allreduce_grads

    @functools.wraps(init_kvstore)
    def _init_kvstore(trainer):
        init_kvstore(trainer)
        if isinstance(trainer._kvstore, store_class):
            trainer._kvstore.attach_trainer(trainer)
            route = trainer._kvstore.route_for(trainer)
            if route is not None:
                trainer._kvstore = route
                trainer._update_on_kvstore = True
                route.set_optimizer(trainer._optimizer)

    @functools.wraps(init_params)
    def _init_params(trainer):
        pending = list(trainer._params_to_init)
        init_params(trainer)
        kv = trainer._kvstore
        if kv is None or "dist" not in str(getattr(kv, "type", "")):
            return
        still_deferred = set(id(p) for p in trainer._params_to_init)
        for param in pending:
            if id(param) not in still_deferred:
                for array in param.list_data():
                    array.wait_to_read()

    @functools.wraps(allreduce_grads)
    def _allreduce_grads(trainer):
        kv = trainer._kvstore
        if isinstance(kv, store_class) and not trainer._update_on_kvstore:
            kv.exchange_step(trainer)
            return
        if isinstance(kv, ServerUpdateStore):
            kv.sync_optimizer(trainer._optimizer)
        allreduce_grads(trainer)

    _GLUON.update(_init_kvstore=init_kvstore, _init_params=init_params,
                  _allreduce_grads=allreduce_grads)
    gluon.Trainer._init_kvstore = _init_kvstore
    gluon.Trainer._init_params = _init_params
    gluon.Trainer._allreduce_grads = _allreduce_grads

