"""In-process transport: one worker, and the 'server' is a decode right here.

The payload takes the same path it takes over the parameter server (encode with
residual, then decode into float32 and aggregate; with compress_pull, encode the
aggregate again with the server's residual and decode that), only without a network:
with one worker the aggregate is that worker's decoded payload.
"""
import time

from .compressors import PullEncoder
from .policy import pull_codec
from .transport import Traffic, Transport


class LocalTransport(Transport):
    """Moves payloads between a worker and itself; see the module docstring.

    compress_pull: None, 'gather', 'layer' or '2bit' (kvstore.policy.compress_pull_mode);
    threshold_scale: of the 2-bit codec that encodes pulls.
    """
    rank = 0
    num_workers = 1
    any_order = True        # each layer's decode is its own

    def __init__(self, compress_pull=None, threshold_scale=1.0):
        self.compress_pull = compress_pull
        self.server = PullEncoder(threshold_scale)

    def init(self, layer, value, probe=False):
        """Nothing to set up: there is no server."""

    def broadcast(self, layer, value, outs):
        for out in outs:
            out[:] = value

    def prepare(self, layers):
        """Nothing to create: there is no server."""

    def exchange(self, items):
        """Decode each (layer, payload, out) into float32 ``out``.

        Returns one Traffic per item: the payload's size, and the size of what a
        distributed pull returns.
        """
        traffic = []
        for layer, payload, out in items:
            pushed_at = time.perf_counter()
            # by the payload's codec: a compressed layer's warm-up steps travel dense
            self.server.compressors[payload.strategy].decode(payload, out)
            codec = pull_codec(layer.plan.strategy, self.compress_pull)
            pulled = 4 * layer.plan.size
            if payload.strategy == "none":
                codec = "none"
            if codec == "gather":     # one worker: its own payload, exactly as decoded
                pulled = payload.nbytes
            elif codec != "none":
                back = self.server.encode(layer.plan.name, codec, out, k=layer.plan.k)
                self.server.compressors[codec].decode(back, out)
                pulled = back.nbytes
            traffic.append(Traffic(pushed=payload.nbytes, pulled=pulled,
                                   pushed_at=pushed_at))
        return traffic

    def server_state(self):
        """{layer name: (residual numpy of the layer's shape, [2-bit threshold or None])}."""
        memory = self.server.memory
        return {name: (memory.get(name).asnumpy(),
                       [memory.scalar(name, "threshold")]) for name in memory.names()}

    def load_server_state(self, state):
        """Replace the server's state with ``state`` (layers absent from it start anew)."""
        self.server.memory = type(self.server.memory)()
        for name, (residual, thresholds) in state.items():
            self.server.set_state(name, residual, thresholds[0] if thresholds else None)
