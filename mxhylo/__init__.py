"""mxhylo: communication-efficient distributed training for MXNet.

Importing mxhylo registers the kvstore types ``hylo`` and ``dist_sync_hylo``
with MXNet, so ``mx.kv.create('hylo')`` and ``gluon.Trainer(..., kvstore='dist_sync_hylo')``
use Hylo's layer-aware gradient compression.
"""
import os
import sys

if sys.version_info[:2] != (3, 11):
    raise ImportError("mxhylo needs Python 3.11 (mxnet 1.9.1 needs numpy<1.24); this is "
                      "Python %d.%d" % sys.version_info[:2])

__version__ = "0.1.0"


def _running_the_launcher():
    """True in ``python -m mxhylo.launch``: the launcher starts processes and needs no
    MXNet (importing it costs each launch about 2 s of CPU)."""
    argv = getattr(sys, "orig_argv", [])
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["mxhylo.launch"]


if _running_the_launcher():
    __all__ = []
else:
    # A parameter server or scheduler runs its whole life inside the first `import mxnet`
    # (MXNet enters the ps-lite loop while importing mxnet.kvstore). Two cases:
    _ROLE = os.environ.get("DMLC_ROLE")
    _SERVE_AFTER_IMPORT = _ROLE in ("server", "scheduler") and "mxnet" not in sys.modules
    if _SERVE_AFTER_IMPORT:
        # 1. mxhylo is imported first (python -m mxhylo.run, or a script importing mxhylo
        #    before mxnet): import MXNet as a worker would, so that it and mxhylo load
        #    whole, then enter the server loop at the end of this file. MXNet reads
        #    DMLC_ROLE when it decides, so the role is only hidden during the import.
        os.environ["DMLC_ROLE"] = "worker"
        try:
            import mxnet  # noqa: E402
        finally:
            os.environ["DMLC_ROLE"] = _ROLE
    else:
        import mxnet  # noqa: E402

    if not hasattr(mxnet, "nd"):
        # 2. mxnet was imported first and this server is unpickling hylo's decoder from
        #    inside that import (mxnet/contrib imports the kvstore module, which starts
        #    the server loop), before mxnet binds its `nd` and `sym` aliases and imports
        #    `library`; ops/build.py registers the operators on both.
        import mxnet.library  # noqa: E402,F401
        import mxnet.ndarray  # noqa: E402
        import mxnet.symbol  # noqa: E402

        mxnet.nd, mxnet.sym = mxnet.ndarray, mxnet.symbol

    from .kvstore import create  # noqa: E402  (registers 'hylo' and 'dist_sync_hylo')


    def __getattr__(name):
        # The trainer and the input pipeline load on first use: a parameter server, which
        # imports mxhylo only for the kvstore's decoder, never needs them.
        if name == "LARSTrainer":
            from .lars import LARSTrainer
            return LARSTrainer
        if name in ("io", "schedules"):
            import importlib
            return importlib.import_module("." + name, __name__)
        raise AttributeError("module 'mxhylo' has no attribute %r" % (name,))

    __all__ = ["create", "io", "schedules", "LARSTrainer"]

    if _SERVE_AFTER_IMPORT:
        from mxnet.kvstore import kvstore_server  # noqa: E402

        kvstore_server._init_kvstore_server_module()     # serves, then exits the process
