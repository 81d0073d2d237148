"""In-process transport: one worker, and the 'server' is a decode right here.

The payload takes the same path it takes over the parameter server (encode with
residual, then decode into float32 and aggregate), only without a network: with one
worker the aggregate is that worker's decoded payload.
"""
import time

from .compressors import make_compressors
from .policy import pull_codec
from .transport import Traffic, Transport


class LocalTransport(Transport):
    """Moves payloads between a worker and itself; see the module docstring.

    compress_pull: None or 'gather' (kvstore.policy.compress_pull_mode): what a
    distributed pull of the same payload would carry, for the traffic it reports.
    """
    rank = 0
    num_workers = 1
    any_order = True        # each layer's decode is its own

    def __init__(self, compress_pull=None):
        self.compress_pull = compress_pull
        self.codecs = make_compressors()

    def broadcast(self, layers, values, outs):
        for value, layer_outs in zip(values, outs):
            for out in layer_outs:
                out[:] = value

    def exchange(self, layers, items):
        """Decode each (layer, payload, out) into float32 ``out``.

        Returns one Traffic per item: the payload's size, and the size of what a
        distributed pull returns.
        """
        traffic = []
        for layer, payload, out in items:
            pushed_at = time.perf_counter()
            # by the payload's codec: a compressed layer's warm-up steps travel dense
            self.codecs[payload.strategy].decode(payload, out)
            gathered = payload.strategy != "none" and \
                pull_codec(layer.plan.strategy, self.compress_pull) == "gather"
            # one worker's gather: its own payload, exactly as decoded
            pulled = payload.nbytes if gathered else 4 * layer.plan.size
            # one worker's totals are its own scalars (kvstore.codec_shared)
            agreed = payload.scalars if getattr(self.codecs[payload.strategy], "summable",
                                                False) else None
            traffic.append(Traffic(pushed=payload.nbytes, pulled=pulled,
                                   pushed_at=pushed_at, agreed=agreed))
        return traffic
