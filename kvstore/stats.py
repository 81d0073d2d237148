"""Traffic accounting of a hylo store: what kv.stats() returns."""
import time


class TrafficStats:
    """Bytes and messages per layer, as the transport really moved them.

    Units: bytes. ``dense_bytes`` is what uncompressed float32 gradients of the same
    layers would have pushed over the same steps.
    """

    def __init__(self):
        self.layers = {}
        self.per_server = {}
        self.messages = 0
        self.seconds = {}

    def record(self, plan, pushed, pulled, messages=1, per_server=None, seconds=None,
               push_s=None):
        """Account one exchange of layer ``plan``: ``pushed``/``pulled`` bytes;
        ``seconds``: what it cost this worker (its encode and its pull's wait and
        decode), kept as ``last_seconds`` and summed in ``seconds``; ``push_s``: when its
        push left, in seconds from the start of the exchange (Trainer.step's call of
        the store, while backward may still run), kept as ``last_push_s``."""
        entry = self.layers.get(plan.name)
        if entry is None:
            entry = self.layers[plan.name] = {
                "policy": plan.strategy, "shape": list(plan.shape), "k": plan.k,
                "rate": plan.rate, "steps": 0, "bytes_pushed": 0, "bytes_pulled": 0,
                "dense_bytes": 0, "last_bytes": 0, "messages": 0,
                "seconds": 0.0, "last_seconds": None, "last_push_s": None}
        entry["steps"] += 1
        entry["bytes_pushed"] += pushed
        entry["bytes_pulled"] += pulled
        entry["dense_bytes"] += 4 * plan.size
        entry["last_bytes"] = pushed
        entry["messages"] += messages
        if seconds is not None:
            entry["seconds"] += seconds
            entry["last_seconds"] = seconds
        entry["last_push_s"] = push_s
        self.messages += messages
        for server, nbytes in (per_server or {}).items():
            self.per_server[server] = self.per_server.get(server, 0) + nbytes

    def record_dense(self, name, shape, messages=1):
        """Account one dense exchange of parameter ``name`` (``shape``) on the servers'
        route: its float32 gradient pushed, its float32 weights pulled."""
        size = 1
        for n in shape:
            size *= int(n)
        self.record(_DenseLayer(name, tuple(shape), size), 4 * size, 4 * size, messages)

    def time(self, phase, since):
        """Add the seconds since ``since`` (time.perf_counter) to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now

    def as_dict(self):
        layers = {}
        for name, e in self.layers.items():
            layers[name] = dict(e, bytes=e["bytes_pushed"],
                                ratio=(e["dense_bytes"] / e["bytes_pushed"])
                                if e["bytes_pushed"] else None)
        steps = max((e["steps"] for e in self.layers.values()), default=0)
        pushed = sum(e["bytes_pushed"] for e in self.layers.values())
        dense = sum(e["dense_bytes"] for e in self.layers.values())
        compressed = [e for e in self.layers.values() if e["policy"] != "none"]
        c_pushed = sum(e["bytes_pushed"] for e in compressed)
        c_dense = sum(e["dense_bytes"] for e in compressed)
        return {
            "steps": steps,
            "bytes_pushed": pushed,
            "bytes_pulled": sum(e["bytes_pulled"] for e in self.layers.values()),
            "dense_bytes": dense,
            # (None: nothing pushed yet, or no layer compressed)
            "ratio": dense / pushed if pushed else None,
            "compressed_layers_ratio": c_dense / c_pushed if c_pushed else None,
            "messages": self.messages,
            "messages_per_step": self.messages / steps if steps else 0.0,
            "bytes_per_server": dict(self.per_server),
            # wall seconds per step of each phase of pushpull: encode (reduce, residual,
            # compress), exchange (pack, issue pushes and pulls), wait (until every
            # aggregate is in: network and server decode), write (copy to the outputs)
            "timing": {k: v / steps for k, v in self.seconds.items()} if steps else {},
            "layers": layers,
        }


class _DenseLayer:
    """What ``TrafficStats.record`` reads of a layer's plan, for a gradient that travels
    dense on the servers' route."""
    strategy, k, rate = "none", None, None

    def __init__(self, name, shape, size):
        self.name, self.shape, self.size = name, shape, size


def cost_model_stats(cost, decisions, layers, rechecks, split_elements):
    """stats()['cost_model']: the fitted wire (latency_s, per_byte_s), the codecs'
    seconds per element, momentum_s, each link alone and what one more message costs
    (message_s), split_elements, re-measurements by cause, and per layer (by name) its
    choice (strategy), predicted dense_s and codec_s, the reason, and measured_s (its
    last_seconds in ``layers``, TrafficStats.as_dict's)."""
    links = cost.links
    return {
        "latency_s": cost.wire.latency_s, "per_byte_s": cost.wire.per_byte_s,
        "codecs": {s: vars(c) for s, c in cost.codecs.items()},
        "momentum_s": cost.momentum_s,
        "links": None if links is None else [vars(l) for l in links.links],
        "message_s": None if links is None else links.message_s,
        "split_elements": split_elements, "rechecks": dict(rechecks),
        "layers": {d.name: {"strategy": d.codec, "dense_s": d.dense_s,
                            "codec_s": d.codec_s, "reason": d.reason,
                            "measured_s": layers.get(d.name, {}).get("last_seconds")}
                   for d in decisions if d.dense_s is not None}}
