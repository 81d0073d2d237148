"""Transport over Horovod's collectives (ring allreduce and allgather, Gloo): no servers.

The path of the seeds' decentralized systems (Baidu's ring allreduce, "ImageNet in
4 minutes"), with hylo's layer-aware codecs:

* layers whose payload is dense float32 (uncompressed layers, and compressed layers
  during their warm-up steps) are summed by one fused ring allreduce
  (``hvd.grouped_allreduce_``, in place in the layers' float32 aggregates);
* compressed layers travel as each worker's own encoded payload, as bytes
  (kvstore.wire's blobs), through one grouped ``hvd.allgather``; every worker then
  decodes the W payloads of a layer in rank order and sums them into the layer's
  aggregate. Every worker runs the same float operations on the same bytes, and the
  ring allreduce hands every worker the same sums, so all workers write bitwise the
  same aggregates.

There is no server, so nothing re-compresses an aggregate on its way back (the
store's compress_pull must be off: the allgather already returns the workers' own
payloads, what compress_pull='gather' pulls from parameter servers) and there is no
server state to checkpoint. Local devices are summed by the store before a payload
is encoded (hierarchical: one payload per worker).

Launch: ``horovodrun -np W -H host:slots --gloo python script.py`` (the store picks
this transport by itself there: kvstore.hylo, transport 'auto').
"""
import os
import time
import zlib
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .. import ops
from .compressors import make_compressors
from .transport import Traffic, Transport
from .wire import blob_payloads, blob_spans, decode_sums, payload_blob, sum_payloads

INSTALL_HINT = (
    "install Horovod with MXNet and Gloo into this environment (make setup does it): "
    "HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 "
    "HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo "
    "pip install --no-build-isolation horovod==0.28.1  (mxnet must be installed first)")

# horovodrun sets these in every process it starts (Gloo and MPI modes alike)
_HOROVODRUN_ENV = ("HOROVOD_RANK", "HOROVOD_SIZE")


def launched_by_horovodrun(environ=None):
    """Whether this process was started by horovodrun (and not as an MXNet
    parameter-server node, which has DMLC_ROLE). Imports nothing."""
    env = os.environ if environ is None else environ
    return all(k in env for k in _HOROVODRUN_ENV) and "DMLC_ROLE" not in env


def import_horovod():
    """horovod.mxnet, initialised; ImportError saying how to install it otherwise."""
    try:
        # a Horovod built without MXNet has no horovod/mxnet/mpi_lib: this import fails
        # ("Extension horovod.mxnet has not been built"); 0.28 has no mxnet_built()
        import horovod.mxnet as hvd
    except ImportError as err:
        raise ImportError("the hylo 'horovod' transport needs horovod.mxnet, which does "
                          "not import (%s); %s" % (err, INSTALL_HINT)) from err
    if not (hvd.gloo_built() or hvd.mpi_built()):
        raise ImportError("horovod.mxnet imports but Horovod was built with neither Gloo "
                          "nor MPI: it cannot run collectives on CPUs; %s" % INSTALL_HINT)
    # (mxhylo's operators may load before or after it: ops/build.py links them with
    # -Bsymbolic, see BASE_FLAGS there)
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def ring_allreduce_bytes(nbytes, num_workers):
    """Bytes one worker sends (and as many it receives) in a ring allreduce of
    ``nbytes``: reduce-scatter then allgather of W segments, 2 (W - 1) / W * nbytes."""
    return 2 * (num_workers - 1) * nbytes // num_workers


def _hold_until_done(sent, results):
    """Keep the arrays handed to Horovod's asynchronous MXNet ops (``sent``) referenced
    until their ``results`` are written. Horovod's ops keep the raw NDArray pointers
    they are given (its mpi_ops.cc captures ``NDArray* input``) and read them on the
    engine's thread later; a temporary freed by Python before then is read freed (a
    worker aborting at start, once in a while, with "Check failed: ctx.dev_mask() ==
    Context::kGPU" and a garbage device mask)."""
    for result in results:
        result.wait_to_read()
    del sent[:]


def ring_allgather_bytes(sizes, rank):
    """(sent, received) bytes of worker ``rank`` in a ring allgather of blocks of
    ``sizes`` bytes (one per worker, rank order), as Gloo's allgatherv runs it: in
    W - 1 steps a worker forwards every block but its successor's, and receives every
    block but its own."""
    total, w = sum(sizes), len(sizes)
    if w == 1:
        return 0, 0
    return total - sizes[(rank + 1) % w], total - sizes[rank]


@dataclass
class _Dense:
    """An item summed by the fused allreduce."""
    index: int
    name: str           # the layer's
    out: mx.nd.NDArray
    nbytes: int         # of the float32 aggregate


@dataclass
class _Gathered:
    """A compressed item: its own blob goes out, every worker's blob comes back."""
    index: int
    layer: object
    out: mx.nd.NDArray
    blob: np.ndarray


def _group_name(kind, names):
    """A collective's name, the same on every worker (the layers' names; Python's
    hash() differs between processes) and the same for the same layers every step
    (Horovod's response cache then skips the negotiation)."""
    return "hylo.%s.%08x.%d" % (kind, zlib.crc32("\0".join(names).encode()), len(names))


class HorovodTransport(Transport):
    """Moves hylo payloads with Horovod's collectives; see the module docstring.

    compress_pull: must be None (off): there is no server to re-compress aggregates.
    The layers of a call travel in grouped collectives named by their order, which
    every worker must enter alike: they come in the order given (any_order False).
    """
    any_order = False

    def __init__(self, compress_pull=None):
        if compress_pull is not None:
            raise ValueError(
                "compress_pull=%r needs parameter servers, and the 'horovod' transport has "
                "none: its allgather already returns every worker's own compressed payload "
                "(what 'gather' pulls from servers). Leave compress_pull at 'auto' or pass "
                "False." % (compress_pull,))
        self.hvd = import_horovod()
        self.rank = self.hvd.rank()
        self.num_workers = self.hvd.size()
        self._codecs = make_compressors()      # decoders of the gathered payloads

    # -- no keys, no servers -------------------------------------------------------------

    def broadcast(self, layers, values, outs):
        """Rank 0's values into every array of ``outs`` (Horovod's broadcast)."""
        sent, results = [], []
        for layer, value, layer_outs in zip(layers, values, outs):
            # A copy: Horovod's MXNet ops cannot read an array in oneDNN's layout ("We
            # can't generate TBlob for MKLDNN data"), which a weight is after a forward
            # outside autograd.record() (oneDNN reorders it in place); a copy is not.
            sent.append(value.copy())
            result = self.hvd.broadcast(sent[-1], root_rank=0,
                                        name="hylo.broadcast." + layer.plan.name)
            results.append(result)
            for out in layer_outs:
                if out.dtype == result.dtype:
                    result.copyto(out)
                else:
                    out[:] = result.astype(out.dtype)
        _hold_until_done(sent, results)

    def every_workers_value(self, value):
        """Every worker's float32 ``value`` by rank (a Horovod allgather; collective)."""
        mine = np.asarray([value], np.float32)
        if self.num_workers == 1:
            return mine
        self._gathers = getattr(self, "_gathers", 0) + 1   # the same count on every worker
        sent = mx.nd.array(mine)
        got = self.hvd.allgather(sent, name="hylo.gather.%d" % self._gathers)
        _hold_until_done([sent], [got])
        return got.asnumpy()

    def share_from_rank0(self, values):
        """Rank 0's 1-D float32 numpy ``values`` on every worker (a Horovod broadcast;
        collective: every worker calls it, with as many values)."""
        values = np.asarray(values, np.float32).ravel()
        if self.num_workers == 1:
            return values
        self._shares = getattr(self, "_shares", 0) + 1     # the same count on every worker
        sent = mx.nd.array(values)
        got = self.hvd.broadcast(sent, root_rank=0, name="hylo.share.%d" % self._shares)
        _hold_until_done([sent], [got])
        return got.asnumpy()

    # -- one exchange --------------------------------------------------------------------

    def exchange(self, layers, items):
        """One exchange: (layer, payload, out) items, out float32 of the layer's shape.

        Dense payloads are copied into their ``out`` and summed there in place by one
        grouped ring allreduce (asynchronous: ``wait`` blocks on it); compressed
        payloads travel as blobs through one grouped allgather (blocking), and each
        ``out`` receives the sum of the W decoded payloads, in rank order, before this
        returns. Returns one Traffic per item (bytes this worker sent and received;
        see ring_allreduce_bytes and ring_allgather_bytes).
        """
        traffic, dense, gathered = [], [], []
        for i, (layer, payload, out) in enumerate(items):
            traffic.append(Traffic())
            if self._codecs[payload.strategy].wire == "dense":
                grad = payload.arrays[0]
                if grad.handle.value != out.handle.value:
                    grad.reshape(out.shape).copyto(out)
                dense.append(_Dense(i, layer.plan.name, out, 4 * layer.plan.size))
            else:
                gathered.append(_Gathered(i, layer, out, payload_blob(payload)))
        pushed_at = time.perf_counter()     # the collectives start now
        if dense and self.num_workers > 1:
            # one group: Horovod fuses it into one buffer, one ring allreduce
            self.hvd.grouped_allreduce_([d.out for d in dense], op=self.hvd.Sum,
                                        name=_group_name("allreduce",
                                                         [d.name for d in dense]))
        for n, d in enumerate(dense):
            moved = ring_allreduce_bytes(d.nbytes, self.num_workers)
            traffic[d.index] = Traffic(pushed=moved, pulled=moved, messages=int(n == 0),
                                       pushed_at=pushed_at)
        if gathered:
            self._gather(gathered, traffic, pushed_at)
        return traffic

    def _gather(self, gathered, traffic, pushed_at):
        """Allgather the blobs of ``gathered``; decode and sum each layer's W payloads."""
        if self.num_workers > 1:
            sends = [mx.nd.array(g.blob, dtype=np.uint8) for g in gathered]
            names = [g.layer.plan.name for g in gathered]
            received = []
            for r in self.hvd.grouped_allgather(sends, name=_group_name("allgather", names)):
                view = ops.host_view(r)     # where Horovod wrote it, no copy (None: a GPU's)
                received.append(r.asnumpy() if view is None else view)
        else:
            received = [g.blob for g in gathered]
        for n, (g, data) in enumerate(zip(gathered, received)):
            spans = blob_spans(data, g.layer.plan.shape)
            if len(spans) != self.num_workers:
                raise RuntimeError("layer %r: %d payloads gathered from %d workers"
                                   % (g.layer.plan.name, len(spans), self.num_workers))
            codec = self._codecs[spans[0].strategy]
            agreed = None
            if getattr(codec, "summable", False):
                # a shared scale: the integer sums, as the servers' 'sum' pull
                payloads = [b.payload for b in blob_payloads(data, g.layer.plan.shape)]
                agreed, packed = sum_payloads(payloads, g.layer.plan.size)
                decode_sums(agreed, packed, g.out.shape, self.num_workers, out=g.out)
            elif hasattr(codec, "decode_gathered") and \
                    all(s.strategy == codec.name for s in spans):
                # rank order in one pass: the same float sums on every worker
                codec.decode_gathered(data, spans, g.layer.plan.size, g.out)
            else:
                g.out[:] = 0
                for b in blob_payloads(data, g.layer.plan.shape):   # rank order, as above
                    self._codecs[b.payload.strategy].decode(
                        b.payload, g.out.reshape(b.payload.shape), accumulate=True)
            sent, got = ring_allgather_bytes([s.nbytes for s in spans], self.rank)
            traffic[g.index] = Traffic(pushed=sent, pulled=got, messages=int(n == 0),
                                       pushed_at=pushed_at, agreed=agreed)
