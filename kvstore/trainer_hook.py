"""The explicit hook between Gluon's Trainer and a hylo store.

Gluon's Trainer hands its store one key per call (the parameter's index) and tells it
neither the parameter's name, nor the step's other keys, nor the optimizer. A hylo store
needs all three: names for the policy's regexes, stats() and errors; the whole step
at once (small layers fused, in the order backward writes them); the optimizer's
momentum (momentum correction). So, as Horovod's DistributedTrainer overrides ``_allreduce_grads``, this
hook replaces three methods of ``gluon.Trainer`` itself, for Trainers whose kvstore is
a hylo store, and leaves every other store to Gluon's own code:

* ``_init_kvstore``: once Gluon has created the Trainer's store, a hylo store is told
  its Trainer (``Hylo.attach_trainer``), before the parameters are broadcast under
  their indices, and plans its parameters (``Hylo.choose_route``): where the plan's
  route puts the optimizer on the servers, the store tells the Trainer to update on
  the kvstore, and stays its store;
* ``_allreduce_grads``: a hylo store exchanges the whole step in one call
  (``Hylo.exchange_step``) instead of Gluon's loop of one pushpull per key, on
  either route;
* ``_check_and_rescale_grad``: where the optimizer runs on the kvstore, Gluon refuses a
  step whose batch size differs from the first one ("Possible change in the
  batch_size"), because MXNet's store sent the optimizer once. A hylo store sends the
  optimizer again whenever a setting changes (its rescale_grad too), so a Trainer of a
  hylo store takes a last, smaller batch on either route.

And one repair of MXNet's own start-up, for every distributed store:

* ``_init_params``: rank 0 hands MXNet copies of the parameters to send, and the
  Trainer waits until the parameters it broadcast have arrived.
  Why copies: after an inference forward, oneDNN keeps a convolution's weight in a
  blocked layout of its own. MXNet's KVStoreDist sends a key's initial value from
  that array in an engine operation that asks for its plain data
  (src/kvstore/kvstore_dist.h PushDefault: ``send_buf.data()``), which raises for
  such an array (src/ndarray/ndarray.cc SetTBlob: "We can't generate TBlob for MKLDNN
  data"); the operation writes no array, so the engine drops the error and the push
  is never sent. Rank 0 then passes the barrier as if its value were stored, and the
  first worker to pull the key ends the job on its server ("init N first",
  src/kvstore/kvstore_dist_server.h:611), or, when a worker's first push-and-pull
  arrives there first, is answered without data and ends itself (ps-lite's
  kv_app.h:624). Whether the weight is still in oneDNN's layout when the push runs
  depends on the engine's timing: oneDNN changes a weight's layout in operations it
  queues while running a forward, so the failure comes and goes. A copy is always in
  the plain layout.
  Why wait: in MXNet 1.9.1's KVStoreDist the pull lands in a fresh buffer on every
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

import mxnet as mx

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
    check_and_rescale_grad = gluon.Trainer._check_and_rescale_grad

    @functools.wraps(init_kvstore)
    def _init_kvstore(trainer):
        init_kvstore(trainer)
        if isinstance(trainer._kvstore, store_class):
            trainer._kvstore.attach_trainer(trainer)
            trainer._kvstore.choose_route(trainer)

    @functools.wraps(init_params)
    def _init_params(trainer):
        kv = trainer._kvstore
        if isinstance(kv, mx.kv.KVStore) and "dist" in kv.type:
            _broadcast_copies(trainer)
            return
        if isinstance(kv, store_class):
            _broadcast_at_once(trainer)
            return
        pending = list(trainer._params_to_init)
        init_params(trainer)
        if kv is not None and "dist" in str(getattr(kv, "type", "")):
            _wait_arrived(trainer, pending)

    @functools.wraps(allreduce_grads)
    def _allreduce_grads(trainer):
        kv = trainer._kvstore
        if isinstance(kv, store_class):
            kv.exchange_step(trainer)
            return
        allreduce_grads(trainer)

    @functools.wraps(check_and_rescale_grad)
    def _check_and_rescale_grad(trainer, scale):
        if isinstance(trainer._kvstore, store_class):
            trainer._optimizer.rescale_grad = scale
            return
        check_and_rescale_grad(trainer, scale)

    _GLUON.update(_init_kvstore=init_kvstore, _init_params=init_params,
                  _allreduce_grads=allreduce_grads,
                  _check_and_rescale_grad=check_and_rescale_grad)
    gluon.Trainer._init_kvstore = _init_kvstore
    gluon.Trainer._init_params = _init_params
    gluon.Trainer._allreduce_grads = _allreduce_grads
    gluon.Trainer._check_and_rescale_grad = _check_and_rescale_grad


def _broadcast_copies(trainer):
    """Gluon's ``_init_params`` for a native distributed store, with rank 0's values
    sent from copies (see the module docstring): every parameter ready to initialise
    in one ``init`` and one ``pull`` (Gluon's broadcast is that init and that pull, a
    barrier for each parameter); then the Trainer waits for them. Deferred parameters
    stay deferred, as in Gluon."""
    kv = trainer._kvstore
    ready = [p for p in trainer._params_to_init if not p._deferred_init]
    trainer._params_to_init = [p for p in trainer._params_to_init if p._deferred_init]
    if not ready:
        return
    keys = [trainer._param2idx[p.name] for p in ready]
    arrays = [p._check_and_get(p._data, list) for p in ready]
    kv.init(keys, [a[0].copy() for a in arrays])
    dense = [(k, a) for k, a, p in zip(keys, arrays, ready) if p._stype == "default"]
    if dense:
        kv.pull([k for k, _ in dense], out=[a for _, a in dense])
    _wait_arrived(trainer, ready)


def _broadcast_at_once(trainer):
    """Gluon's ``_init_params`` for a hylo store: every parameter ready to initialise in
    one ``broadcast`` (Gluon's loop makes one call per parameter, and each is a barrier
    of the job over the parameter server); then the Trainer waits for them. Deferred
    parameters stay deferred, as in Gluon."""
    ready = [p for p in trainer._params_to_init if not p._deferred_init]
    trainer._params_to_init = [p for p in trainer._params_to_init if p._deferred_init]
    if not ready:
        return
    arrays = [p._check_and_get(p._data, list) for p in ready]
    trainer._kvstore.broadcast([trainer._param2idx[p.name] for p in ready],
                               [a[0] for a in arrays], out=arrays)
    _wait_arrived(trainer, ready)


def _wait_arrived(trainer, params):
    """Wait until the values pulled into ``params`` (those no longer deferred) arrived."""
    still_deferred = set(id(p) for p in trainer._params_to_init)
    for param in params:
        if id(param) not in still_deferred:
            for array in param.list_data():
                array.wait_to_read()
