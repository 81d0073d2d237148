"""Compile and load the C++ operator library (ops/src/hylo_ops.cc) on first use.

No manual step: ``load()`` builds ``libhylo_ops-<key>.so`` the first time a
process needs it and loads it into MXNet with ``mx.library.load``; later
processes find it cached. ``load()`` runs once per process (the result, or
the error, is remembered).

Where: ``ops/_build/`` next to this file, or ``$XDG_CACHE_HOME/mxhylo``
(default ``~/.cache/mxhylo``) when that is not writable (a read-only
install), or ``$MXHYLO_BUILD_DIR`` when set.

Cache key: sha256 of the operator source, MXNet's lib_api.h/lib_api.cc, the
MXNet version, the compiler command and flags, and the CPU model (the flags
include -march=native, so a library built on one CPU must not be reused on
another that shares the cache directory, e.g. an NFS home).

Concurrency: the parameter-server roles of a job (scheduler, servers,
workers) often start at the same moment. Builders serialise on an fcntl
lock file per key, compile to a temporary name and ``os.replace`` it into
place, so a reader never sees a half-written library and the compiler runs
once.

Environment:
  MXHYLO_CXX        compiler (default: c++ / g++ on PATH)
  MXHYLO_CXXFLAGS   extra flags appended to the defaults (part of the key)
  MXHYLO_BUILD_DIR  build/cache directory
"""
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

import mxnet as mx

SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")
SOURCE = os.path.join(SRC_DIR, "hylo_ops.cc")

# -march=native (measured with mxhylo.bench ops, 16M elements, 1 thread):
# quantize_2bit 8.6 GB/s vs 0.24 GB/s for generic x86-64, whose SSE2 cannot
# if-convert the selects; it also enables the AVX-512 kernels and F16C.
# -fopenmp: large tensors are split over OpenMP threads; the count follows
# OMP_NUM_THREADS, else MXNet's own choice for its operators (1 on a 2-vCPU
# machine). A second thread helped when a core was idle (quantize 7.5 -> 9.2
# GB/s) and hurt when the machine was shared.
BASE_FLAGS = ["-O3", "-std=c++11", "-shared", "-fPIC", "-march=native", "-fopenmp"]
COMPILE_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The library could not be compiled or loaded; the message says why."""


def _mxnet_dir():
    return os.path.dirname(os.path.abspath(mx.__file__))


def lib_api_paths():
    """(include dir, lib_api.cc) shipped inside the mxnet wheel."""
    root = _mxnet_dir()
    return os.path.join(root, "include"), os.path.join(root, "src", "lib_api.cc")


def compiler():
    """The compiler command as a list: $MXHYLO_CXX, else c++ or g++ on PATH."""
    env = os.environ.get("MXHYLO_CXX")
    if env:
        return shlex.split(env)
    for name in ("c++", "g++"):
        path = shutil.which(name)
        if path:
            return [path]
    raise BuildError("no C++ compiler found (set MXHYLO_CXX or install g++)")


def flags():
    return BASE_FLAGS + shlex.split(os.environ.get("MXHYLO_CXXFLAGS", ""))


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(cxx, cxxflags):
    """Hex digest naming the library: sources + mxnet version + compiler/flags + CPU."""
    include, lib_api_cc = lib_api_paths()
    h = hashlib.sha256()
    for path in (SOURCE, lib_api_cc, os.path.join(include, "mxnet", "lib_api.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    for part in [mx.__version__, _cpu_model()] + list(cxx) + list(cxxflags):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _writable_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def build_dir():
    """The first writable of $MXHYLO_BUILD_DIR, ops/_build, the user cache."""
    env = os.environ.get("MXHYLO_BUILD_DIR")
    if env:
        if not _writable_dir(env):
            raise BuildError("MXHYLO_BUILD_DIR=%s is not a writable directory" % env)
        return env
    local = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build")
    if _writable_dir(local):
        return local
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "mxhylo")
    if _writable_dir(cache):
        return cache
    raise BuildError("neither %s nor %s is writable" % (local, cache))


def _compile(cxx, cxxflags, target, log_path):
    include, lib_api_cc = lib_api_paths()
    cmd = list(cxx) + cxxflags + ["-I", include, SOURCE, lib_api_cc, "-o", target]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError("compiler %r could not run: %s" % (cxx[0], err)) from None
    output = proc.stdout.decode(errors="replace")
    with open(log_path, "w") as f:
        f.write(" ".join(shlex.quote(c) for c in cmd) + "\n" + output)
    if proc.returncode != 0 or not os.path.exists(target):
        tail = output.strip().splitlines()[-3:]
        raise BuildError("%s exited with status %d (log: %s)%s" % (
            cxx[0], proc.returncode, log_path, (": " + " | ".join(tail)) if tail else ""))


def build():
    """Return the path of an up-to-date library, compiling it if needed."""
    cxx = compiler()
    cxxflags = flags()
    key = cache_key(cxx, cxxflags)
    directory = build_dir()
    target = os.path.join(directory, "libhylo_ops-%s.so" % key)
    if os.path.exists(target):
        return target
    with open(os.path.join(directory, "libhylo_ops-%s.lock" % key), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(target):  # another process built it while we waited
            return target
        fd, tmp = tempfile.mkstemp(prefix=".libhylo_ops-%s." % key, suffix=".so", dir=directory)
        os.close(fd)
        try:
            _compile(cxx, cxxflags, tmp, os.path.join(directory, "libhylo_ops-%s.log" % key))
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


_lock = threading.Lock()
_state = {}


def load():
    """Build (if needed) and load the library once per process; return its path.

    Raises BuildError, every time it is called, if the first attempt failed.
    """
    with _lock:
        if "path" in _state:
            return _state["path"]
        if "error" in _state:
            raise _state["error"]
        try:
            path = build()
            mx.library.load(path, verbose=False)
            if not hasattr(mx.nd, "hylo_quantize_2bit"):
                raise BuildError("%s loaded but registered no hylo_* operators" % path)
        except BuildError as err:
            _state["error"] = err
            raise
        except Exception as err:  # mx.library.load raises MXNetError, OSError, ...
            _state["error"] = BuildError("loading the operator library failed: %s" % err)
            raise _state["error"] from None
        _state["path"] = path
        return path


def _c_library():
    """ctypes view of the loaded library: dlopen of the same path returns
    MXNet's handle, so these calls reach the globals the operators use."""
    import ctypes
    return ctypes.CDLL(load())


def set_num_threads(n):
    """Threads the C++ kernels use; 0 = follow OpenMP (OMP_NUM_THREADS). Returns n."""
    return _c_library().hylo_set_num_threads(int(n))


def set_simd(on):
    """Use the AVX-512 kernels (when compiled in, the default) or the portable
    loops; returns whether AVX-512 is now in use. For tests and the benchmark."""
    return bool(_c_library().hylo_set_simd(1 if on else 0))
