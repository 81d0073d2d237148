"""In-process transport: one worker, and the 'server' is a decode right here.

The payload takes the same path it takes over the parameter server (encode with
residual, then decode into float32 and aggregate), only without a network: with one
worker the aggregate is that worker's decoded payload.
"""


class LocalTransport:
    """Moves payloads between a worker and itself; see the module docstring."""
    rank = 0
    num_workers = 1

    def init(self, layer, value):
        """Nothing to set up: there is no server."""

    def broadcast(self, layer, value, outs):
        for out in outs:
            out[:] = value

    def exchange(self, items):
        """Decode each (layer, payload, out) into float32 ``out``.

        Returns, per item, (bytes pushed, bytes pulled, {server: bytes}, messages):
        the payload's size, and the dense float32 aggregate a distributed pull returns.
        """
        traffic = []
        for layer, payload, out in items:
            layer.compressor.decode(payload, out)
            traffic.append((payload.nbytes, 4 * layer.plan.size, {}, 0))
        return traffic
