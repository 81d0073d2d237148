"""mxhylo: communication-efficient distributed training for MXNet.

Importing mxhylo registers the kvstore types ``hylo`` and ``dist_sync_hylo``
with MXNet, so ``mx.kv.create('hylo')`` and ``gluon.Trainer(..., kvstore='dist_sync_hylo')``
use Hylo's layer-aware gradient compression.
"""
import sys

if sys.version_info[:2] != (3, 11):
    raise ImportError("mxhylo needs Python 3.11 (mxnet 1.9.1 needs numpy<1.24); this is "
                      "Python %d.%d" % sys.version_info[:2])

__version__ = "0.1.0"

from .kvstore import create  # noqa: E402  (registers 'hylo' and 'dist_sync_hylo')
from . import io  # noqa: E402


def __getattr__(name):
    # LARSTrainer is imported on first use: most kvstore users never need it.
    if name == "LARSTrainer":
        from .lars import LARSTrainer
        return LARSTrainer
    raise AttributeError("module 'mxhylo' has no attribute %r" % (name,))


__all__ = ["create", "io", "LARSTrainer"]
