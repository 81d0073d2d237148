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

import mxnet  # noqa: E402

if not hasattr(mxnet, "nd"):
    # This is a parameter server unpickling hylo's decoder: a server runs its whole
    # life inside `import mxnet` (MXNet enters the server loop while importing
    # mxnet.kvstore), before mxnet binds its `nd` alias and imports `library`.
    import mxnet.library  # noqa: E402,F401
    import mxnet.ndarray  # noqa: E402

    mxnet.nd = mxnet.ndarray

from .kvstore import create  # noqa: E402  (registers 'hylo' and 'dist_sync_hylo')


def __getattr__(name):
    # The trainer and the input pipeline load on first use: a parameter server, which
    # imports mxhylo only for the kvstore's decoder, never needs them.
    if name == "LARSTrainer":
        from .lars import LARSTrainer
        return LARSTrainer
    if name == "io":
        import importlib
        return importlib.import_module(".io", __name__)
    raise AttributeError("module 'mxhylo' has no attribute %r" % (name,))


__all__ = ["create", "io", "LARSTrainer"]
