"""The one interface the hylo store moves payloads through, and what it reports back.

Three transports implement it: kvstore.transport_local (one process: the 'server' is a
decode right here), kvstore.transport_ps (MXNet's parameter server) and
kvstore.transport_horovod (Horovod's ring allreduce and allgather). The exchange
(kvstore.pipeline) calls, per step: ``exchange(layers, items)`` (items may be a
generator that encodes on demand), then ``wait(layers, aggregates, traffic)``.
"""
import abc
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np


@dataclass
class Traffic:
    """What one layer's exchange put on the wire, in bytes of payload values and row
    ids (not ps-lite's own message headers).

    pushed, pulled: bytes this worker sent and received; per_server: server index ->
    bytes both ways; messages: pushes (each has one pull); pull_s: seconds this worker
    spent blocked on the layer's aggregate and decoding it (what the exchange costs it
    past the encode: the wire, the servers, the decode; a layer whose aggregate came
    while an earlier one was awaited costs little here); pushed_at: time.perf_counter()
    when the layer's first push was handed to the network library (None: no push);
    agreed: a shared-scale codec's payload scalars summed over the workers, alike on
    every worker (kvstore.codec_shared), or None; set by the time the transport's
    wait() returns.
    """
    pushed: int = 0
    pulled: int = 0
    per_server: Dict[int, int] = field(default_factory=dict)
    messages: int = 0
    pull_s: float = 0.0
    pushed_at: Optional[float] = None
    agreed: Optional[tuple] = None

    def count(self, server, pushed=0, pulled=0, messages=0):
        self.pushed += pushed
        self.pulled += pulled
        self.per_server[server] = self.per_server.get(server, 0) + pushed + pulled
        self.messages += messages


def wait_timed(aggregate, traffic):
    """Block until ``aggregate`` (NDArray) is written; add the seconds to traffic.pull_s."""
    clock = time.perf_counter()
    aggregate.wait_to_read()
    traffic.pull_s += time.perf_counter() - clock


class Transport(abc.ABC):
    """Moves one worker's encoded layers to the aggregation and the aggregates back.

    rank, num_workers: this worker and the job's size (attributes). any_order: whether
    ``exchange`` takes a call's layers in any order, so that they can come as backward
    writes their gradients (every worker may take them in a different order);
    collectives that every worker must enter in the same order cannot. split_elements:
    from how many float32 elements on the wire a layer is cut over several links (None:
    never). num_servers: servers that could run a Trainer's optimizer (0: none; see
    server_route).
    """
    rank = 0
    num_workers = 1
    num_servers = 0
    any_order = False
    split_elements = None   # from how many elements on the wire a layer is cut, if ever

    @abc.abstractmethod
    def broadcast(self, layers, values, outs):
        """Per layer of ``layers``, write rank 0's value (``values``: one NDArray per
        layer) into every NDArray of its ``outs`` (one list per layer), creating the
        layers' keys first (every worker calls this with the same layers, in order)."""

    def replan(self, old, new):
        """Layer ``old`` travels under ``new``'s plan from the next exchange on (the
        same key and shape; a re-plan). Collective: every worker calls it at the same
        point, between exchanges. Transports without keys (in-process, Horovod's
        collectives) have nothing to do."""

    @abc.abstractmethod
    def exchange(self, layers, items):
        """Move (layer, payload, out) items: every worker's payloads of a layer,
        aggregated, end up in its float32 ``out`` (written asynchronously: see
        ``wait``). ``layers``: the call's layers in the order given (the same on every
        worker: what is fused or created for the exchange is fixed by it); the items
        come in any order if any_order. Returns one Traffic per item, in the items'
        order."""

    def wait(self, layers, aggregates, traffic):
        """Block until every aggregate of the exchange is written; add the seconds
        blocked on each to its Traffic's pull_s (``traffic``: what exchange returned)."""
        for agg, t in zip(aggregates, traffic):
            wait_timed(agg, t)

    def time_links(self, probe_elements, repeats):
        """kvstore.cost_model.LinkCosts of this transport's aggregation links, each
        timed alone with dense probes of ``probe_elements`` float32 values, rank 0's
        figures on every worker (collective), which the transport then places and
        cuts the keys it makes by; or None where there are no links to choose between
        (in-process; Horovod's ring)."""
        return None

    def server_route(self, params):
        """A kvstore.server_route.ServerRoute for a Trainer's ``params`` (its optimizer
        run on the servers), or None where there are no servers."""
        return None

    def every_workers_value(self, value):
        """Every worker's float32 ``value``, by rank, on every worker: float32 numpy
        (num_workers,) (collective). In one process: the value itself."""
        if self.num_workers > 1:
            raise NotImplementedError("%s cannot gather values from workers"
                                      % type(self).__name__)
        return np.asarray([value], np.float32)

    def share_from_rank0(self, values):
        """Rank 0's 1-D float32 numpy ``values`` on every worker (collective). In one
        process: the values themselves."""
        if self.num_workers > 1:
            raise NotImplementedError("%s cannot share values between workers"
                                      % type(self).__name__)
        return np.asarray(values, np.float32).ravel()
