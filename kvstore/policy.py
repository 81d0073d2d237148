"""Layer policy: which compression each parameter's gradient gets, from its name and shape.

The rule (Hylo's layer types, 2-bit for both kinds of weight):

* fewer than ``size_threshold`` elements -> ``none``: small tensors cost latency, not
  bandwidth, so they travel as they are.
* 4-D weight (O, I, kh, kw), a convolution -> ``fc_2bit``, as a fully connected layer
  below: part of every element every step. Why not Hylo's top-k filters: top-k saves
  bytes only by making filters wait. At a rate whose k filters cost fewer bytes than
  2 bits per element (under about 1/16) each filter waits 16 steps or more in the
  residual (42 steps for resnet18's 512x512x3x3 layers at the adaptive rate below),
  and on time to accuracy (resnet18 on the digits, 4 workers, runs of 6 paired seeds)
  top-k conv layers ended 0.78 and 0.48 point behind dist_sync and were never sooner;
  2-bit conv layers ended -0.19, -0.04, -0.71 and +0.26 and were sooner in three of
  four runs (docs/BENCHMARKS.md, "Time to accuracy"). What 2 bits cost:
  the gathered pull brings each worker W 2-bit payloads of every conv element (one
  C++ pass decodes them: ops.decode_carried_2bit); resnet50_v1b's step at 1 Gbit/s
  with 4 workers and 2 servers on 2 cores took 1.18x top-k's (more bytes to pull and
  decode), still under dist_sync's.
  ``conv_rate`` given -> ``conv_topk``: each step sends the k = max(1, round(rate * O))
  output filters of largest L2 norm (gradient + residual), a bytes-for-staleness trade
  for long jobs. ``conv_topk`` named in ``policy`` without ``conv_rate`` takes the
  layer-adaptive rate

      rate(n) = clip(MAX_CONV_RATE * (RATE_REFERENCE_SIZE / n) ** 0.25,
                     MIN_CONV_RATE, MAX_CONV_RATE)

  for a layer of n parameters: a layer of 8192 parameters sends 10% of its filters, a
  256x larger one 2.5%, never fewer than 1%.
* 2-D weight (out, in), a fully connected layer -> ``fc_2bit``: every element is sent
  as one of {-v, 0, +v} (v: the mean |g + r| of the elements sent); the threshold that
  decides which are sent adapts to the size of that layer's values,

      t = mean(|g + r|)

  (g the gradient, r the residual; the mean is taken in the same pass as the previous
  step's quantization, see mxhylo.kvstore.compressors.TwoBit).
* anything else above the threshold (1-D, 3-D, 5-D ...) -> ``none``.

``policy`` overrides the rule: a dict of regular expressions (matched with re.search
against the parameter name) to strategies, tried in order; ``{'.*': 'none'}`` turns
compression off. A regex that maps a tensor to a strategy its shape cannot take
(``conv_topk`` for a 1-D bias, say) is an error, not a silent fallback.
"""
import re
from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np

# the strategies the rule below chooses; overrides may name any codec of the registry
# (kvstore.compressors.CODECS), e.g. 'fp16'
STRATEGIES = ("none", "conv_topk", "fc_2bit")

DEFAULT_SIZE_THRESHOLD = 8192
# the adaptive conv rate (the rule above): a layer of RATE_REFERENCE_SIZE parameters
# sends MAX_CONV_RATE of its filters, bigger ones less, never under MIN_CONV_RATE
RATE_REFERENCE_SIZE = 8192
MAX_CONV_RATE = 0.1
MIN_CONV_RATE = 0.01


@dataclass(frozen=True)
class LayerPlan:
    """How one parameter's gradient travels.

    name: parameter name; shape: its shape; strategy: one of STRATEGIES;
    rate: fraction of output filters sent per step (conv_topk only);
    k: number of filters sent per step (conv_topk only).
    """
    name: str
    shape: Tuple[int, ...]
    strategy: str
    rate: Optional[float] = None
    k: Optional[int] = None
    # number of elements of the parameter; computed once (the exchange asks for it
    # several times per layer and step)
    size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "size", int(np.prod(self.shape)) if self.shape else 1)


def adaptive_conv_rate(n):
    """Fraction of a conv layer's filters sent per step, for a layer of n parameters."""
    rate = MAX_CONV_RATE * (float(RATE_REFERENCE_SIZE) / float(n)) ** 0.25
    return float(min(MAX_CONV_RATE, max(MIN_CONV_RATE, rate)))


class LayerPolicy:
    """Maps (name, shape) to a LayerPlan; see the module docstring for the rule."""

    def __init__(self, size_threshold=DEFAULT_SIZE_THRESHOLD, conv_rate=None, policy=None):
        if not isinstance(size_threshold, (int, np.integer)) or size_threshold < 0:
            raise ValueError("size_threshold must be a non-negative int (elements), got %r"
                             % (size_threshold,))
        if conv_rate is not None and not 0.0 < conv_rate <= 1.0:
            raise ValueError("conv_rate must be None (adaptive) or a fraction in (0, 1], "
                             "got %r" % (conv_rate,))
        self.size_threshold = int(size_threshold)
        self.conv_rate = conv_rate
        from .compressors import CODEC_NAMES     # (the codecs import LayerPlan from here)
        self.overrides = []
        for pattern, strategy in (policy or {}).items():
            if strategy not in CODEC_NAMES:
                raise ValueError("policy %r -> %r: strategy must be one of %s"
                                 % (pattern, strategy, ", ".join(CODEC_NAMES)))
            try:
                self.overrides.append((re.compile(pattern), strategy))
            except re.error as err:
                raise ValueError("policy key %r is not a valid regular expression: %s"
                                 % (pattern, err)) from None

    def options(self):
        """The constructor arguments, for logs and for rebuilding the policy elsewhere."""
        return {"size_threshold": self.size_threshold, "conv_rate": self.conv_rate,
                "policy": {p.pattern: s for p, s in self.overrides}}

    def plan(self, name, shape):
        """The LayerPlan of parameter ``name`` with ``shape`` (a tuple of ints)."""
        shape = tuple(int(d) for d in shape)
        for pattern, strategy in self.overrides:
            if pattern.search(name):
                return self._make(name, shape, strategy, forced=True)
        n = int(np.prod(shape)) if shape else 1
        if n < self.size_threshold:
            strategy = "none"
        elif len(shape) == 4:
            strategy = "fc_2bit" if self.conv_rate is None else "conv_topk"
        elif len(shape) == 2:
            strategy = "fc_2bit"
        else:
            strategy = "none"
        return self._make(name, shape, strategy, forced=False)

    def plan_as(self, name, shape, strategy):
        """The LayerPlan of ``name`` with ``shape`` under ``strategy``, as an override
        would make it (the cost model's probes; its choice of 'none' for a layer)."""
        return self._make(name, tuple(int(d) for d in shape), strategy, forced=True)

    def _make(self, name, shape, strategy, forced):
        if strategy == "conv_topk":
            if len(shape) < 2 or shape[0] < 1:
                raise ValueError("policy maps %r of shape %s to conv_topk, which needs a "
                                 "weight of shape (O, ...) with O >= 1 output filters"
                                 % (name, shape))
            n = int(np.prod(shape))
            rate = self.conv_rate if self.conv_rate is not None else adaptive_conv_rate(n)
            k = max(1, int(round(rate * shape[0])))
            return LayerPlan(name, shape, strategy, rate=rate, k=k)
        if strategy == "fc_2bit" and len(shape) == 0:
            raise ValueError("policy maps scalar %r to fc_2bit" % (name,))
        return LayerPlan(name, shape, strategy)


# -- the way back: how a compressed layer's aggregate returns (compress_pull) ---------

def compress_pull_mode(value, distributed=True):
    """Normalise the compress_pull option to 'gather' or None.

    'gather' (what 'auto' and True mean over the parameter server): the servers return
    the workers' own compressed payloads, gathered (a conv layer's filters that any
    worker sent, summed; an fc layer's W 2-bit slots), and every worker decodes them:
    the aggregate is exactly the dense pull's, for about W times the pushed bytes.
    False / None: the aggregate comes back dense float32 (Hylo as published; what
    'auto' and True mean in one process and over Horovod, where there is no pull to
    save or the allgather already gathers).
    """
    if value in ("auto", True, "gather"):
        return "gather" if distributed else None
    if value is None or value is False:
        return None
    if value in ("layer", "2bit", "off"):
        raise ValueError(
            "compress_pull=%r is no longer offered: the servers' re-compressed pulls "
            "converged worse than the dense pull. Use compress_pull='gather' (the "
            "default: the exact compressed pull) or False (the dense aggregate)%s"
            % (value, "" if value != "off" else "; 'off' is now False"))
    raise ValueError("compress_pull must be 'auto', True, 'gather' or False, got %r"
                     % (value,))


def pull_codec(strategy, mode):
    """How a layer's aggregate comes back: 'none' (the dense float32 aggregate) or
    'gather' (the workers' own payloads). Layers pushed uncompressed ('none') are
    pulled dense: they are small, latency not bandwidth."""
    if mode is None or strategy == "none":
        return "none"
    return "gather"
