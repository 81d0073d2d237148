"""BatchNorm over every worker's batch: ``python -m mxhylo.run --sync-batchnorm``.

W workers with batch b each normalize over their own b samples, where one process with
batch W*b normalizes over all of them; on small per-worker batches (and small maps
late in a net) that trains measurably worse. With --sync-batchnorm every Gluon
BatchNorm layer, in training, normalizes with the mean and variance of the whole
batch of all W workers, back-propagates through those statistics as one process
would, and keeps running statistics that are the same on every worker. Evaluation
(not training) uses the running statistics, as Gluon's BatchNorm does.

A layer, forward (autograd differentiates each operator; backward runs them in
reverse):

1. ``hylo_bn_moments`` (C++, ops/src/batchnorm_ops.cc): x (N, C, ...) -> this
   worker's per-channel mean m and centred sum of squares q, each (1, C, 1, ...).
2. ``mxhylo_sync_moments`` (a CustomOp, so it runs inside hybridized graphs too):
   sums n, n*m and q + n*m^2 over the workers in float64 (1 + 2C values, one round
   trip) and outputs the whole batch's mean and biased variance (1, C, 1, ...); moves
   the layer's running statistics (its momentum), as MXNet's BatchNorm does. Its
   backward sums the gradients of the mean and variance over the workers (2C values,
   one more round trip) first: the loss is the sum of every worker's, and every
   worker's outputs depend on every worker's moments.
3. ``hylo_bn_normalize`` (C++): y = (x - mean) gamma / sqrt(var + eps) + beta.

Where mxhylo's C++ operators do not apply (a GPU, float16, MXHYLO_OPS=reference),
1 and 3 are broadcast operators with the same arithmetic.

Cost: two round trips per BatchNorm layer and step (53 layers in resnet50_v1b) of
8 + 16 C bytes each, each waiting for the slowest worker; three operators for MXNet's
one fused BatchNorm.

The sums go through mxhylo.reducer: a small TCP service in a process the rank-0
worker starts, which adds the W workers' values in rank order, so every worker
receives the same bytes. Its address reaches the workers through the job's store
(one ``broadcast`` at start-up), so it runs under every launcher the store runs
under. A worker that stops leaves the others waiting at most ``timeout`` seconds,
then their step fails with an error that says so.
"""
import os
import socket

import mxnet as mx
import numpy as np

from .reducer import TIMEOUT_S, Reducer, spawn_service

OP_TYPE = "mxhylo_sync_moments"
# The store key of the address (an int: MXNet's stores refuse a mix of int and str keys,
# and Gluon's Trainer uses ints from 0 up).
ADDRESS_KEY = 2 ** 31 - 1

def _reachable_ip():
    """This host's address as the job's other hosts reach it: the source address of
    the route to the scheduler (ps-lite) or to horovodrun's rendezvous."""
    host = os.environ.get("DMLC_NODE_HOST")
    if host:
        return socket.gethostbyname(host)   # (an address or a host name)
    peer = os.environ.get("DMLC_PS_ROOT_URI") or \
        os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((peer, 9))                # (UDP: nothing is sent)
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def join(kv, timeout=TIMEOUT_S):
    """The job's Reducer: rank 0 starts its service (a child process), and the
    service's address reaches every worker through ``kv.broadcast`` (a collective:
    every worker calls join once, at start)."""
    address = np.zeros(5, dtype=np.float32)
    if kv.rank == 0 and kv.num_workers > 1:
        # bound to the address the job's other hosts reach, never to all interfaces
        # (loopback for a job on one machine), as mxhylo.launch binds every role
        ip = _reachable_ip()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ip, 0))
        listener.listen(128)
        spawn_service(listener, kv.num_workers, timeout)
        address[:4] = [int(p) for p in socket.inet_aton(ip)]
        address[4] = listener.getsockname()[1]
        listener.close()                    # (the service has its own copy)
    out = mx.nd.zeros(5)
    kv.broadcast(ADDRESS_KEY, mx.nd.array(address), out=out)
    got = out.asnumpy().astype(int)
    ip = ".".join(str(p) for p in got[:4])
    return Reducer(kv.rank, kv.num_workers, (ip, int(got[4])), timeout)


# ----------------------------------------------------------------------------- the operator

_REDUCER = None


class _SyncMoments(mx.operator.CustomOp):
    """This worker's moments -> the whole batch's, over every worker.

    Inputs: m (1, C, 1, ...), this worker's per-channel mean; q (same shape), its
    centred sum of squares sum((x - m)^2); size (1,) float64, x.size; gamma and beta
    (C,), not read (there for shape inference). Outputs: the mean and biased variance
    of the W workers' batches together, shaped as m. Aux: the running mean and
    variance (C,), moved in training; returned as they are in evaluation.

    The moments are combined in float64 (Chan et al.'s pairwise formula), so the
    variance keeps its precision when the mean is large against the spread.
    """

    def __init__(self, key, momentum):
        super().__init__()
        if _REDUCER is None:
            raise RuntimeError("sync BatchNorm: no reducer (mxhylo.sync_batchnorm.install "
                               "was not called, or was undone)")
        self.reducer = _REDUCER         # (taken now: the operator runs later, async)
        self.key, self.momentum = key, float(momentum)
        self.samples = None             # this worker's samples per channel, n_w
        self.total = None               # all workers', n

    def forward(self, is_train, req, in_data, out_data, aux):
        # (numpy in and out: a few small copies; each MXNet operator called from
        # here would cost more than all of this arithmetic)
        shape = out_data[0].shape
        if not is_train:
            _write(out_data[0], req[0], aux[0].asnumpy().reshape(shape))
            _write(out_data[1], req[1], aux[1].asnumpy().reshape(shape))
            return
        m = in_data[0].asnumpy().astype(np.float64).ravel()
        q = in_data[1].asnumpy().astype(np.float64).ravel()
        n = float(in_data[2].asnumpy()[0]) / m.size
        total = self.reducer.sum(self.key + ":forward",
                                 np.concatenate([[n], n * m, q + n * m * m]))
        c = m.size
        count = total[0]
        mean = total[1:1 + c] / count
        var = np.maximum(total[1 + c:] / count - mean * mean, 0.0)
        self.samples, self.total = n, count
        _write(out_data[0], req[0], mean.reshape(shape))
        _write(out_data[1], req[1], var.reshape(shape))
        mo = self.momentum
        for running, batch in zip(aux, (mean, var)):
            running[:] = running.asnumpy() * mo + batch * (1 - mo)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        # The job's loss is the sum of every worker's, and every worker's outputs depend
        # on every worker's moments: sum the output gradients over the workers first.
        g_mean = out_grad[0].asnumpy().astype(np.float64).ravel()
        g_var = out_grad[1].asnumpy().astype(np.float64).ravel()
        c = g_mean.size
        total = self.reducer.sum(self.key + ":backward", np.concatenate([g_mean, g_var]))
        g_mean, g_var = total[:c], total[c:]
        m = in_data[0].asnumpy().astype(np.float64).ravel()
        mean = out_data[0].asnumpy().astype(np.float64).ravel()
        share = self.samples / self.total
        shape = in_data[0].shape
        _write(in_grad[0], req[0], (share * (g_mean + 2.0 * (m - mean) * g_var)).reshape(shape))
        _write(in_grad[1], req[1], (g_var / self.total).reshape(shape))
        for i in (2, 3, 4):                 # size, gamma, beta: no gradient through here
            if req[i] in ("write", "inplace"):
                in_grad[i][:] = 0


def _write(dst, req, value):
    """dst (NDArray) = or += value (numpy, dst's shape) by MXNet's request ``req``."""
    if req in ("write", "inplace"):
        dst[:] = value
    elif req == "add":
        dst[:] = dst.asnumpy() + value


@mx.operator.register(OP_TYPE)
class _SyncMomentsProp(mx.operator.CustomOpProp):
    def __init__(self, key, momentum="0.9"):
        super().__init__(need_top_grad=True)
        self.key, self.momentum = key, float(momentum)

    def list_arguments(self):
        return ["mean", "centred_squares", "size", "gamma", "beta"]

    def list_outputs(self):
        return ["mean", "var"]

    def list_auxiliary_states(self):
        return ["running_mean", "running_var"]

    def infer_shape(self, in_shape):
        stat = list(in_shape[0])
        channel = [int(np.prod(stat))]
        return [stat, stat, [1], channel, channel], [stat, stat], [channel, channel]

    def infer_type(self, in_type):
        t = in_type[0]
        return [t, t, np.float64, t, t], [t, t], [t, t]

    def create_operator(self, ctx, shapes, dtypes):
        return _SyncMoments(self.key, self.momentum)


# ----------------------------------------------------------------------------- the layer

def _moments(F, x, axis, cpp):
    """This worker's per-channel mean and centred sum of squares, (1, C, 1, ...)."""
    if cpp:
        return F.hylo_bn_moments(x, axis=axis)
    m = F.mean(x, axis=axis, exclude=True, keepdims=True)
    return m, F.sum(F.square(F.broadcast_sub(x, m)), axis=axis, exclude=True, keepdims=True)


def _normalize(F, x, mean, var, gamma, beta, kw, cpp):
    """(x - mean) gamma / sqrt(var + eps) + beta, the statistics (1, C, 1, ...)."""
    eps, fix_gamma = kw.get("eps", 1e-5), kw.get("fix_gamma", False)
    if cpp:
        return F.hylo_bn_normalize(x, mean, var, gamma, beta, axis=kw.get("axis", 1),
                                   eps=eps, fix_gamma=int(bool(fix_gamma)))
    inv_std = F.rsqrt(var + eps)
    if not fix_gamma:
        inv_std = F.broadcast_mul(inv_std, F.reshape_like(gamma, mean))
    return F.broadcast_add(F.broadcast_mul(F.broadcast_sub(x, mean), inv_std),
                           F.reshape_like(beta, mean))


def _use_cpp(block):
    """mxhylo's C++ halves of BatchNorm for a float32 layer on the CPU; the broadcast
    operators otherwise (GPU, float16, MXHYLO_OPS=reference)."""
    from mxhylo import ops
    try:
        contexts = block.gamma.list_ctx()
    except RuntimeError:                # deferred initialization: not placed yet
        contexts = [mx.current_context()]
    return (all(c.device_type.startswith("cpu") for c in contexts)
            and np.dtype(block.gamma.dtype) == np.float32 and ops.backend() == "cpp")


def _sync_forward(block, F, x, gamma, beta, running_mean, running_var):
    """_BatchNorm.hybrid_forward over every worker's batch (same kwargs, same output)."""
    kw = block._kwargs
    cpp = _use_cpp(block)
    m, q = _moments(F, x, kw.get("axis", 1), cpp)
    size = F.cast(F.size_array(x), dtype="float64")
    # (gamma and beta go in only so that deferred shape inference knows their shape)
    mean, var = F.Custom(m, q, size, gamma, beta, running_mean, running_var,
                         op_type=OP_TYPE, key=block.name,
                         momentum=str(kw.get("momentum", 0.9)))
    y = _normalize(F, x, mean, var, gamma, beta, kw, cpp)
    if getattr(block, "fuse_relu", False):
        y = F.relu(y)
    return y


def install(reducer):
    """Make every Gluon BatchNorm layer normalize over all workers' batches (sums through
    ``reducer``); returns the function that undoes it."""
    global _REDUCER
    from mxnet.gluon.nn.basic_layers import _BatchNorm
    from mxnet.util import is_np_array

    _REDUCER = reducer
    original = _BatchNorm.hybrid_forward

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if is_np_array() or self._kwargs.get("use_global_stats"):
            return original(self, F, x, gamma, beta, running_mean, running_var)
        return _sync_forward(self, F, x, gamma, beta, running_mean, running_var)

    _BatchNorm.hybrid_forward = hybrid_forward

    def undo():
        global _REDUCER
        _BatchNorm.hybrid_forward = original
        _REDUCER = None
    return undo
