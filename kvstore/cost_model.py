"""Which layers compression pays for, from measured costs (the default policy's second half).

The layer policy (kvstore.policy) says what a layer *could* be compressed with; this
model says whether that pays on this machine and this network. A layer is compressed
only where its predicted exchange is shorter than its dense exchange by ``margin``;
elsewhere it travels dense. At 1 Gbit/s almost every large layer compresses; on a fast
network, where encoding costs more than the bytes it saves, layers stay dense and hylo
is no slower than a dense exchange.

Model of one layer's exchange, in seconds, for a layer of n float32 elements:

    dense:            t = latency + 4n * per_byte
    codec c:          t = latency + max(up, down) * per_byte + encode_c(n) + decode
        up   = p, the payload's bytes (Compressor.payload_nbytes)
        down = W * p  ('gather' pull: every worker's payload comes back)
               4n     (dense pull)
               W/2 * p  ('allgather', the Horovod transport: see below)
        decode = payloads decoded by this worker (W with 'gather' and 'allgather',
                 else 0) x decode_c(n)
        + n * momentum_s where momentum correction will run on the layer (a
          momentum-SGD Trainer drives the store, kvstore.momentum): its passes over
          the velocity and the previous aggregate are work a dense layer does not do

Work that is the same either way (the optimizer on the workers) is left out.

``latency`` and ``per_byte`` come from timed exchanges of dense probe layers of two
sizes through the real transport, with every worker exchanging at once (so per_byte
holds the servers' share of the load: W workers' bytes go through S server links, and
the servers' summing). encode_c and decode_c are seconds per element, timed on a
synthetic layer per codec. The sums of up and down are the bytes that cross the
busiest link (a worker's, or a server's scaled by W/S: the same factor for both
forms, which per_byte carries). Over Horovod the dense probes are ring allreduces: a
worker sends and receives 2(W-1)/W of the layer's bytes, which per_byte carries;
an allgather of p bytes per worker brings in (W-1) p, that is W/2 * p in those units
(up: p, sent (W-1) times along the ring, is the same W/2 * p on the outgoing link).
The model leaves out the overlap of one layer's encode with another's transfer: it
errs towards dense.

Where the transport has links of its own to choose between (the parameter server: one
per server), each is timed alone too (LinkCosts): a dense probe key on that server,
every worker at once, at two sizes, and one exchange of several small keys against one
of their total size (what one more message costs). From these the transport places
each key on the server where it is predicted to finish first (a slower link takes
fewer bytes) and cuts a layer over the servers only where the bytes that saves on the
busiest link outweigh the extra messages (LinkCosts.split_min_elements): the number of
pieces of a layer is the model's, not a fixed size.

Every worker must reach the same plan (the servers' layouts depend on it): rank 0
measures, and the transport shares its numbers (CostModel.to_array / from_array).
The store measures at start-up (kvstore.measure) and again when its exchange drifts,
and plans every layer again then (kvstore.planner).
"""
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from .compressors import make_compressors
from ..ops.formats import packed_nbytes

# the codecs' own facts: which aggregates the servers sum as integers (codec_shared)
_CODECS = make_compressors()

DEFAULT_MARGIN = 0.1          # compress only when predicted >= 10% faster than dense


@dataclass(frozen=True)
class WireCost:
    """One dense exchange of b bytes per worker takes latency_s + b * per_byte_s seconds."""
    latency_s: float
    per_byte_s: float

    @classmethod
    def fit(cls, nbytes, seconds):
        """Least-squares line through (bytes, seconds) points, clamped to >= 0."""
        x = np.asarray(nbytes, np.float64)
        y = np.asarray(seconds, np.float64)
        if x.size < 2 or np.ptp(x) == 0:
            raise ValueError("WireCost.fit needs exchanges of at least two sizes")
        slope, intercept = np.polyfit(x, y, 1)
        slope = max(float(slope), 1e-13)
        return cls(max(float(intercept), 0.0), slope)


# links whose per-byte cost is within this factor of the fastest one's count as equally
# fast: timing noise must not move keys between servers of a symmetric cluster
LINK_TOLERANCE = 1.25
# a layer is never cut into pieces of fewer elements than this (nor kept whole past
# the wire's chunk size, kvstore.wire)
MIN_SPLIT_ELEMENTS = 1 << 12


@dataclass(frozen=True)
class LinkCosts:
    """Each aggregation link alone: links[s] is a dense exchange of b bytes per worker
    through server s alone (every worker at once): latency_s + b * per_byte_s seconds.
    message_s: seconds one more key adds to one exchange (the per-message work of the
    worker, the network library and the server, beyond latency and bytes)."""
    links: Tuple[WireCost, ...]
    message_s: float

    def placement_weights(self):
        """Per server, seconds per byte for placing keys: the fastest link's figure for
        every link within LINK_TOLERANCE of it (equal links place keys exactly as
        equal loads would), the link's own otherwise."""
        fastest = min(l.per_byte_s for l in self.links)
        return tuple(fastest if l.per_byte_s <= LINK_TOLERANCE * fastest else l.per_byte_s
                     for l in self.links)

    def split_min_elements(self):
        """float32 elements on the wire (per worker, the larger direction) from which a
        layer is cut into a multiple of the number of servers S: cutting it saves
        b * per_byte * (1 - 1/S) seconds on the busiest link and costs (S - 1) *
        message_s, so it pays from b = S * message_s / per_byte bytes (per_byte: the
        median link's)."""
        servers = len(self.links)
        per_byte = float(np.median([l.per_byte_s for l in self.links]))
        return max(MIN_SPLIT_ELEMENTS, int(servers * self.message_s / per_byte / 4))

    @classmethod
    def fit(cls, nbytes, seconds, one_key_s, many_keys_s, keys):
        """From ``seconds[s][j]`` (server s, probe of ``nbytes[j]`` bytes) and one
        exchange of one key (``one_key_s``) against ``keys`` keys of the same total
        (``many_keys_s``)."""
        links = tuple(WireCost.fit(nbytes, row) for row in seconds)
        return cls(links, max(0.0, (many_keys_s - one_key_s) / (keys - 1)))

    def to_list(self):
        values = [float(len(self.links)), self.message_s]
        for l in self.links:
            values += [l.latency_s, l.per_byte_s]
        return values

    @classmethod
    def from_list(cls, values):
        """(LinkCosts or None, number of values read) from the front of ``values``."""
        servers = int(round(values[0]))
        if servers == 0 or len(values) < 2 + 2 * servers:
            return None, 2 + 2 * servers
        links = tuple(WireCost(values[2 + 2 * s], values[3 + 2 * s]) for s in range(servers))
        return cls(links, values[1]), 2 + 2 * servers


@dataclass(frozen=True)
class CodecCost:
    """Seconds per element of a layer to encode it, and to decode one payload of it."""
    encode_s: float
    decode_s: float


@dataclass(frozen=True)
class Prediction:
    """The model's view of one layer: seconds dense, seconds with its codec, the choice."""
    dense_s: float
    codec_s: float
    strategy: str


@dataclass
class CostModel:
    """Measured costs of this job (see the module docstring) and the rule built on them.

    wire: WireCost; codecs: strategy -> CodecCost; workers: W; pull: the store's
    compress_pull mode (None or 'gather'), or 'allgather' over Horovod;
    margin: fraction by which the codec must beat dense; momentum_s: seconds per
    element of momentum correction's passes (time_momentum); links: each aggregation
    link alone (LinkCosts), None where the transport has no links to choose between.
    """
    wire: WireCost
    codecs: Dict[str, CodecCost]
    workers: int
    pull: object = "gather"
    margin: float = DEFAULT_MARGIN
    momentum_s: float = 0.0
    decisions: Dict[str, Prediction] = field(default_factory=dict)
    links: Optional[LinkCosts] = None

    def predict(self, plan, payload_nbytes, momentum=False):
        """Prediction for LayerPlan ``plan`` whose codec sends ``payload_nbytes`` bytes;
        ``momentum``: whether momentum correction would run on it, compressed."""
        dense_bytes = 4 * plan.size
        dense = self.wire.latency_s + dense_bytes * self.wire.per_byte_s
        if plan.strategy == "none":
            return Prediction(dense, dense, "none")
        cost = self.codecs[plan.strategy]
        if getattr(_CODECS[plan.strategy], "summable", False) and self.pull != "allgather":
            # the servers' integer sums, one decode (mxhylo.ops.formats; 30 bits a value)
            down, decodes = packed_nbytes(plan.size, self.workers) * 32 / 30, 1
        elif self.pull == "gather":
            down, decodes = self.workers * payload_nbytes, self.workers
        elif self.pull == "allgather":
            down, decodes = self.workers * payload_nbytes / 2.0, self.workers
        elif self.pull is None:
            down, decodes = dense_bytes, 0
        else:
            raise ValueError("the cost model's pull is 'gather', 'allgather' or None, got %r"
                             % (self.pull,))
        codec = (self.wire.latency_s + max(payload_nbytes, down) * self.wire.per_byte_s
                 + plan.size * (cost.encode_s + decodes * cost.decode_s
                                + (self.momentum_s if momentum else 0.0)))
        chosen = plan.strategy if codec < (1.0 - self.margin) * dense else "none"
        return Prediction(dense, codec, chosen)

    def decide(self, plan, payload_nbytes, momentum=False):
        """The strategy for ``plan`` (its own, or 'none'); remembered for stats()."""
        prediction = self.predict(plan, payload_nbytes, momentum)
        self.decisions[plan.name] = prediction
        return prediction.strategy

    # -- sharing rank 0's numbers --------------------------------------------------------

    def to_array(self, strategies):
        """float64 numpy [latency, per_byte, momentum_s, (encode, decode) per strategy
        in order, then LinkCosts.to_list (or [0, 0]: no links)]."""
        values = [self.wire.latency_s, self.wire.per_byte_s, self.momentum_s]
        for s in strategies:
            values += [self.codecs[s].encode_s, self.codecs[s].decode_s]
        values += self.links.to_list() if self.links is not None else [0.0, 0.0]
        return np.array(values, np.float64)

    @classmethod
    def from_array(cls, array, strategies, workers, pull, margin=DEFAULT_MARGIN):
        a = [float(v) for v in np.asarray(array, np.float64).ravel()]
        head = 3 + 2 * len(strategies)
        links, n = LinkCosts.from_list(a[head:]) if len(a) >= head + 2 else (None, 2)
        if len(a) != head + n:
            raise ValueError("cost model array of %d values for %d strategies"
                             % (len(a), len(strategies)))
        codecs = {s: CodecCost(a[3 + 2 * i], a[4 + 2 * i]) for i, s in enumerate(strategies)}
        return cls(WireCost(a[0], a[1]), codecs, workers, pull, margin, momentum_s=a[2],
                   links=links)


# -- measuring a codec -------------------------------------------------------------------

def time_momentum(elements=1 << 20, repeats=3, seed=0):
    """Seconds per element of momentum correction's two passes on a compressed layer
    (ops.momentum_velocity, then ops.momentum_correct on the aggregate), median of
    ``repeats`` after one warm-up."""
    import time
    import mxnet as mx
    from .. import ops

    rng = np.random.RandomState(seed)
    grad = mx.nd.array(rng.normal(0, 0.01, size=elements).astype(np.float32))
    velocity = mx.nd.zeros(elements)
    aggregate, previous = grad.copy(), mx.nd.zeros(elements)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        v = ops.momentum_velocity(grad, velocity, 0.9)
        ops.momentum_correct(aggregate, previous, 0.9)
        v.wait_to_read()
        aggregate.wait_to_read()
        previous.wait_to_read()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:])) / elements


# synthetic layers the codecs are timed on: a 3x3 conv of 256 filters, a 1024x1024 fc
PROBE_SHAPES = {"conv_topk": (256, 256, 3, 3), "fc_2bit": (1024, 1024)}


def time_codec(policy, compressor, repeats=3, seed=0):
    """CodecCost of ``compressor`` (seconds per element, median of ``repeats`` after one
    warm-up) on the synthetic layer of its strategy, planned by ``policy``."""
    import time
    import mxnet as mx
    from .memory import ResidualMemory

    shape = PROBE_SHAPES.get(compressor.name, (1024, 1024))
    plan = policy.plan_as("__cost_probe__", shape, compressor.name)
    rng = np.random.RandomState(seed)
    grad = mx.nd.array(rng.normal(0, 0.01, size=shape).astype(np.float32))
    out = mx.nd.zeros(shape, dtype=np.float32)
    memory = ResidualMemory()
    enc, dec = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        payload = compressor.encode(plan, grad, memory)
        for a in payload.arrays:
            a.wait_to_read()
        t1 = time.perf_counter()
        compressor.decode(payload, out, accumulate=True)
        out.wait_to_read()
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return CodecCost(float(np.median(enc[1:])) / plan.size,
                     float(np.median(dec[1:])) / plan.size)


class ExchangeDrift:
    """Whether a worker's exchanges have become slower or faster than they were right
    after the cost model's last measurement: the event that calls for measuring again.

    ``add(seconds)`` takes each step's exchange (wall seconds); the baseline is the
    median of the first ``window`` steps after ``reset()``, the current figure the
    median of the last ``window``; ``drifted()`` when their ratio leaves [1/factor,
    factor]. Medians: one slow step on a shared machine is not an event.
    """

    def __init__(self, factor, window=20):
        if not factor > 1.0:
            raise ValueError("the drift factor must be > 1, got %r" % (factor,))
        self.factor, self.window = float(factor), int(window)
        self.reset()

    def reset(self):
        self.baseline = []
        self.recent = []

    def add(self, seconds):
        if len(self.baseline) < self.window:
            self.baseline.append(seconds)
            return
        self.recent.append(seconds)
        del self.recent[:-self.window]

    def drifted(self):
        if len(self.recent) < self.window:
            return False
        ratio = float(np.median(self.recent)) / max(float(np.median(self.baseline)), 1e-9)
        return not (1.0 / self.factor <= ratio <= self.factor)
