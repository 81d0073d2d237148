"""Layer policy: which compression each parameter's gradient gets, from its name and shape.

The rule (Hylo):

* fewer than ``size_threshold`` elements -> ``none``: small tensors cost latency, not
  bandwidth, so they travel as they are.
* 4-D weight (O, I, kh, kw), a convolution -> ``conv_topk``: each step sends the
  k = max(1, round(rate * O)) output filters of largest L2 norm (gradient + residual),
  with the layer-adaptive rate

      rate(n) = clip(max_conv_rate * (size_threshold / n) ** 0.25, min_conv_rate, max_conv_rate)

  for a layer of n parameters: a layer at the size threshold sends 10% of its filters,
  a 256x larger one 2.5%, never fewer than 1% (defaults). The fourth root keeps big
  layers from being starved: their filters still come round within a few dozen steps.
  ``conv_rate`` fixes the rate instead.
  Unless ``conv_rate`` is given, a conv layer whose k filters would take at least the
  bytes of 2 bits per element (rate >= about 1/16: layers up to about 54 K elements
  with the defaults) goes ``fc_2bit`` instead: for no more bytes, 2 bits send part of
  every element every step, where top-k leaves most filters waiting 10-16 steps in
  the residual. That wait was what made resnet20 slower per step than dense in the
  accuracy study (conv_net and digits_net moved within their noise; README,
  "Accuracy").
* 2-D weight (out, in), a fully connected layer -> ``fc_2bit``: every element is sent
  as one of {-v, 0, +v} (v: the mean |g + r| of the elements sent); the threshold that
  decides which are sent adapts to the size of that layer's values,

      t = threshold_scale * mean(|g + r|)

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
DEFAULT_MAX_CONV_RATE = 0.1
DEFAULT_MIN_CONV_RATE = 0.01
DEFAULT_THRESHOLD_SCALE = 1.0


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


def adaptive_conv_rate(n, size_threshold=DEFAULT_SIZE_THRESHOLD,
                       max_rate=DEFAULT_MAX_CONV_RATE, min_rate=DEFAULT_MIN_CONV_RATE):
    """Fraction of a conv layer's filters sent per step, for a layer of n parameters."""
    rate = max_rate * (float(size_threshold) / float(n)) ** 0.25
    return float(min(max_rate, max(min_rate, rate)))


class LayerPolicy:
    """Maps (name, shape) to a LayerPlan; see the module docstring for the rule."""

    def __init__(self, size_threshold=DEFAULT_SIZE_THRESHOLD, conv_rate=None, policy=None,
                 max_conv_rate=DEFAULT_MAX_CONV_RATE, min_conv_rate=DEFAULT_MIN_CONV_RATE,
                 threshold_scale=DEFAULT_THRESHOLD_SCALE):
        if not isinstance(size_threshold, (int, np.integer)) or size_threshold < 0:
            raise ValueError("size_threshold must be a non-negative int (elements), got %r"
                             % (size_threshold,))
        if conv_rate is not None and not 0.0 < conv_rate <= 1.0:
            raise ValueError("conv_rate must be None (adaptive) or a fraction in (0, 1], "
                             "got %r" % (conv_rate,))
        if not 0.0 < min_conv_rate <= max_conv_rate <= 1.0:
            raise ValueError("need 0 < min_conv_rate <= max_conv_rate <= 1, got %r, %r"
                             % (min_conv_rate, max_conv_rate))
        if not threshold_scale > 0:
            raise ValueError("threshold_scale must be > 0, got %r" % (threshold_scale,))
        self.size_threshold = int(size_threshold)
        self.conv_rate = conv_rate
        self.max_conv_rate = float(max_conv_rate)
        self.min_conv_rate = float(min_conv_rate)
        self.threshold_scale = float(threshold_scale)
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
                "policy": {p.pattern: s for p, s in self.overrides},
                "max_conv_rate": self.max_conv_rate, "min_conv_rate": self.min_conv_rate,
                "threshold_scale": self.threshold_scale}

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
            strategy = "conv_topk"
            if self.conv_rate is None and self._two_bits_cost_no_more(name, shape):
                strategy = "fc_2bit"
        elif len(shape) == 2:
            strategy = "fc_2bit"
        else:
            strategy = "none"
        return self._make(name, shape, strategy, forced=False)

    def _two_bits_cost_no_more(self, name, shape):
        """Whether fc_2bit's payload of a conv weight is no larger than conv_topk's at
        the layer's adaptive rate (the codecs' own byte counts)."""
        from .compressors import ConvTopK, TwoBit
        topk = self._make(name, shape, "conv_topk", forced=False)
        return (TwoBit(self.threshold_scale).payload_nbytes(topk)
                <= ConvTopK().payload_nbytes(topk))

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
            rate = self.conv_rate if self.conv_rate is not None else adaptive_conv_rate(
                n, max(self.size_threshold, 1), self.max_conv_rate, self.min_conv_rate)
            k = max(1, int(round(rate * shape[0])))
            return LayerPlan(name, shape, strategy, rate=rate, k=k)
        if strategy == "fc_2bit" and len(shape) == 0:
            raise ValueError("policy maps scalar %r to fc_2bit" % (name,))
        return LayerPlan(name, shape, strategy)


# -- the way back: how the servers return a layer's aggregate (compress_pull) ----------

def compress_pull_mode(value, distributed=True):
    """Normalise the compress_pull option.

    'gather' (what 'auto' means over the parameter server): the servers return the
    workers' own compressed payloads, gathered (a conv layer's filters that any worker
    sent, summed; an fc layer's W 2-bit slots), and every worker decodes them: the
    aggregate is exactly the dense pull's, for about W times the pushed bytes.
    False / None / 'off': the aggregate comes back dense float32 (Hylo as published;
    'auto' in one process, where there is no pull to save);
    True / 'layer': re-compressed by the servers with the codec of the layer's own
    family (conv_topk layers' aggregates as top-k filters at the layer's rate, fc_2bit
    layers' as 2-bit), the rest kept in server-side residuals: the fewest bytes, but
    a second error-feedback delay that slows convergence per step (README, "Accuracy");
    '2bit': every compressed layer's aggregate as 2-bit, the same way.
    Returns None, 'gather', 'layer' or '2bit'.
    """
    if value == "auto":
        return "gather" if distributed else None
    if value is None or value is False or value == "off":
        return None
    if value is True or value == "layer":
        return "layer"
    if value in ("2bit", "gather"):
        return value
    raise ValueError("compress_pull must be 'auto', 'gather', False, 'off', True, 'layer' "
                     "or '2bit', got %r" % (value,))


def pull_codec(strategy, mode):
    """Codec of a layer's pull, named as the codecs are: 'none' (the dense float32
    aggregate), 'fc_2bit' or 'conv_topk' (re-compressed by the servers), or 'gather'
    (the workers' own payloads). Layers pushed uncompressed ('none') are pulled dense:
    they are small, latency not bandwidth."""
    if mode is None or strategy == "none":
        return "none"
    if mode == "gather":
        return "gather"
    if mode == "2bit":
        return "fc_2bit"
    # 'layer': the layer's own family where the servers have a pull encoder for it
    return strategy if strategy in ("fc_2bit", "conv_topk") else "none"
