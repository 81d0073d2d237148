"""Compile and load the C++ operator library (ops/src/*.cc) on first use.

No manual step: ``load()`` builds ``libhylo_ops-<key>.so`` the first time a
process needs it and loads it into MXNet with ``mx.library.load``; later
processes find it cached. ``load()`` runs once per process (the result, or
the error, is remembered).

Where: ``ops/_build/`` next to this file, or ``$XDG_CACHE_HOME/mxhylo``
(default ``~/.cache/mxhylo``) when that is not writable (a read-only
install), or ``$MXHYLO_BUILD_DIR`` when set.

ISA level: ``MXHYLO_ISA`` (or the ``isa`` argument of build()/load()) picks
the instruction set the library is compiled for (-march=...):
  native     this CPU's own (the default; AVX-512 where the CPU has it)
  x86-64-v4  AVX-512 (F, BW, CD, DQ, VL)
  x86-64-v3  AVX2, FMA, F16C, BMI (any x86 CPU since about 2015)
  x86-64-v2  SSE4.2, POPCNT
  x86-64     the portable baseline (SSE2), also spelled 'baseline'
Every level computes bitwise the same results (one source, no per-ISA
arithmetic; tests/unit/test_ops.py compares the builds). A process loads ONE
library into MXNet (the operator names would clash): to compare levels, use
one process per level (python -m mxhylo.bench ops does). load() refuses a
level this CPU cannot run, naming the missing CPU features (see
missing_features()), instead of dying on an illegal instruction.

Cache key: sha256 of the operator source, MXNet's lib_api.h/lib_api.cc, the
MXNet version, the compiler command and flags (which include -march=<level>),
and, for 'native', the CPU model (a library built for one CPU must not be
reused on another that shares the cache directory, e.g. an NFS home).

Concurrency: the parameter-server roles of a job (scheduler, servers,
workers) often start at the same moment. Builders serialise on an fcntl
lock file per key, compile to a temporary name and ``os.replace`` it into
place, so a reader never sees a half-written library and the compiler runs
once.

Environment:
  MXHYLO_ISA        ISA level (default native), see above
  MXHYLO_CXX        compiler (default: c++ / g++ on PATH)
  MXHYLO_CXXFLAGS   extra flags appended to the defaults (part of the key)
  MXHYLO_BUILD_DIR  build/cache directory
"""
import ctypes
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
# every source of the one library: the compression operators and BatchNorm's halves
SOURCES = (SOURCE, os.path.join(SRC_DIR, "batchnorm_ops.cc"))

# One thread, no OpenMP: every kernel runs on the MXNet engine thread that
# calls it. Each pass of a kernel runs near memory speed on one thread with AVX2
# or AVX-512 (python -m mxhylo.bench ops), and an OpenMP team left behind by a kernel
# would wait (spinning first) on cores that forward and backward need.
# -ffp-contract=off: no FMA contraction, so float results cannot depend on
# whether the level has FMA. -Wno-psabi: the GCC vector types of the kernels
# are always inlined, never passed across an ABI boundary. -Wl,-Bsymbolic: the
# library binds the lib_api functions it defines (MXNet's lib_api.cc, compiled in)
# to itself. Without it, once anything loads libmxnet.so with RTLD_GLOBAL, as
# horovod.mxnet does, they bind to libmxnet's copies: loading the library then
# crashes (segmentation fault) and operators loaded before abort ("free(): invalid
# pointer"); measured with mxnet 1.9.1 and horovod 0.28.1.
BASE_FLAGS = ["-O3", "-std=c++11", "-shared", "-fPIC", "-ffp-contract=off", "-Wno-psabi",
              "-Wl,-Bsymbolic"]

# ISA level -> (-march value, /proc/cpuinfo flags the level needs). The flag
# lists are the x86-64 psABI levels (each includes the ones before it).
_V2 = ["cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"]
_V3 = _V2 + ["abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"]
_V4 = _V3 + ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
ISA_LEVELS = {
    "native": ("native", []),
    "x86-64-v4": ("x86-64-v4", _V4),
    "x86-64-v3": ("x86-64-v3", _V3),
    "x86-64-v2": ("x86-64-v2", _V2),
    "x86-64": ("x86-64", ["sse2"]),
}
ISA_ALIASES = {"baseline": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4",
               "v2": "x86-64-v2", "v3": "x86-64-v3", "v4": "x86-64-v4"}
DEFAULT_ISA = "native"
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


def normalize_isa(isa=None):
    """The canonical name of an ISA level: `isa`, else $MXHYLO_ISA, else 'native'."""
    if isa is None:
        isa = os.environ.get("MXHYLO_ISA", "").strip() or DEFAULT_ISA
    name = ISA_ALIASES.get(isa.lower(), isa.lower())
    if name not in ISA_LEVELS:
        raise BuildError("unknown ISA level %r (MXHYLO_ISA): choose from %s" % (
            isa, ", ".join(list(ISA_LEVELS) + sorted(ISA_ALIASES))))
    return name


def flags(isa=None):
    """Compiler flags for an ISA level (default: $MXHYLO_ISA, else native)."""
    march = ISA_LEVELS[normalize_isa(isa)][0]
    return BASE_FLAGS + ["-march=" + march] + shlex.split(os.environ.get("MXHYLO_CXXFLAGS", ""))


def cpu_flags():
    """The set of feature flags /proc/cpuinfo lists for this CPU (empty if unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def is_x86_64():
    return platform.machine().lower() in ("x86_64", "amd64")


def missing_features(isa=None, cpu=None):
    """CPU features an ISA level needs that this CPU (or the `cpu` flag set) lacks.

    [] when the level can run here. On a CPU that is not x86-64, every level
    but 'native' is missing 'x86-64'.
    """
    name = normalize_isa(isa)
    if name == "native":
        return []
    if cpu is None:
        if not is_x86_64():
            return ["x86-64"]
        cpu = cpu_flags()
        if not cpu:  # no /proc/cpuinfo: cannot tell, let the loader try
            return []
    return [f for f in ISA_LEVELS[name][1] if f not in cpu]


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(cxx, cxxflags):
    """Hex digest naming the library: sources + mxnet version + compiler/flags (+ the
    CPU model when the flags say -march=native)."""
    include, lib_api_cc = lib_api_paths()
    h = hashlib.sha256()
    for path in SOURCES + (lib_api_cc, os.path.join(include, "mxnet", "lib_api.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    cpu = [cpu_model()] if "-march=native" in cxxflags else []
    for part in [mx.__version__] + cpu + list(cxx) + list(cxxflags):
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
    cmd = list(cxx) + cxxflags + ["-I", include] + list(SOURCES) + [lib_api_cc, "-o", target]
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


def build(isa=None):
    """Return the path of an up-to-date library for an ISA level (default:
    $MXHYLO_ISA, else native), compiling it if needed."""
    cxx = compiler()
    cxxflags = flags(isa)
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
OP_PREFIX = "hylo_"


def _load_library(path):
    """Register the library's operators with MXNet and make their NDArray functions
    (``mx.nd.hylo_*``).

    What mx.library.load does, for these operators only: it regenerates the Python
    function of every one of MXNet's ~1000 operators, NDArray and Symbol, which took
    1.7-2.0 s of each worker's start on a loaded core. The compression operators are
    called imperatively only (ops/_cpp.py), so they get NDArray functions; BatchNorm's
    halves (hylo_bn_*) go into hybridized graphs too, so they get Symbol ones as well.
    """
    from mxnet.base import _LIB, OpHandle, c_str, check_call, py_str
    from mxnet.ndarray.register import _make_ndarray_function
    from mxnet.symbol.register import _make_symbol_function
    if not os.path.isabs(path) or not os.path.exists(path):
        raise BuildError("operator library %s does not exist (an absolute path is needed)"
                         % path)
    check_call(_LIB.MXLoadLib(c_str(path), ctypes.c_uint(0)))
    size, names = ctypes.c_uint(), ctypes.POINTER(ctypes.c_char_p)()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(names)))
    for name in [py_str(names[i]) for i in range(size.value)]:
        if name.startswith(OP_PREFIX):
            handle = OpHandle()
            check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
            function = _make_ndarray_function(handle, name, name)
            setattr(mx.nd.op, name, function)
            setattr(mx.nd, name, function)
            if name.startswith(OP_PREFIX + "bn_"):
                symbol_function = _make_symbol_function(handle, name, name)
                setattr(mx.sym.op, name, symbol_function)
                setattr(mx.sym, name, symbol_function)


def load(isa=None):
    """Build (if needed) and load the library once per process; return its path.

    isa: the ISA level (default: $MXHYLO_ISA, else native). One library per
    process: asking for another level after one is loaded raises BuildError.
    Raises BuildError, every time it is called, if the first attempt failed.
    """
    with _lock:
        if "error" in _state:
            raise _state["error"]
        try:
            name = normalize_isa(isa)
        except BuildError as err:
            if "path" in _state:  # a bad argument must not poison the loaded library
                raise
            _state["error"] = err
            raise
        if "path" in _state:
            if isa is not None and name != _state["isa"]:
                raise BuildError("this process already loaded the %s library (%s); one "
                                 "process can load only one (run %s in a subprocess)" % (
                                     _state["isa"], _state["path"], name))
            return _state["path"]
        try:
            missing = missing_features(name)
            if missing:
                raise BuildError("ISA level %s needs CPU features this CPU lacks: %s" % (
                    name, ", ".join(missing)))
            path = build(name)
            _load_library(path)
            if not hasattr(mx.nd, "hylo_quantize_2bit"):
                raise BuildError("%s loaded but registered no hylo_* operators" % path)
        except BuildError as err:
            _state["error"] = err
            raise
        except Exception as err:  # mx.library.load raises MXNetError, OSError, ...
            _state["error"] = BuildError("loading the operator library failed: %s" % err)
            raise _state["error"] from None
        _state["path"] = path
        _state["isa"] = name
        return path


def loaded_isa():
    """The ISA level of the library this process loaded, or None."""
    return _state.get("isa")


def _c_library():
    """ctypes view of the loaded library: dlopen of the same path returns
    MXNet's handle, so these calls reach the globals the operators use. Made once per
    process (a dlopen per call cost a worker 28 ms a step of resnet50's exchange)."""
    import ctypes
    path = load()
    with _lock:
        if _state.get("cdll_path") != path:
            _state["cdll"], _state["cdll_path"] = ctypes.CDLL(path), path
        return _state["cdll"]


def build_info():
    """What the loaded library was compiled with, as a dict: the ISA level and the
    instruction sets the compiler targeted, e.g. {'isa': 'x86-64-v3', 'avx2': True,
    'avx512f': False, 'f16c': True, 'openmp': False, 'simd_kernels': False}."""
    import ctypes
    lib = _c_library()
    lib.hylo_build_info.restype = ctypes.c_char_p
    info = {"isa": loaded_isa()}
    for item in lib.hylo_build_info().decode().split():
        key, _, value = item.partition("=")
        info[key] = value == "1"
    return info


def notify_ready_address():
    """The address of the library's MXNet engine callback hylo_notify_ready (an
    EngineSyncFunc that writes a record into a pipe; mxhylo/kvstore/readiness.py)."""
    import ctypes
    return ctypes.cast(_c_library().hylo_notify_ready, ctypes.c_void_p).value


def set_num_threads(n):
    """Kept for compatibility: the kernels run on the calling thread (no OpenMP,
    see BASE_FLAGS). Returns 1."""
    _c_library()
    return 1


def sum_carried_2bit(slots, offset, size, out, bad):
    """The library's hylo_sum_carried_2bit on C-contiguous numpy arrays (arguments
    checked by mxhylo.ops.sum_carried_2bit)."""
    import ctypes
    fn = _c_library().hylo_sum_carried_2bit
    fn.restype = None
    ptr = ctypes.c_void_p
    fn(ptr(slots.ctypes.data), ctypes.c_int64(slots.shape[0]), ctypes.c_int64(slots.shape[1]),
       ctypes.c_int64(offset), ctypes.c_int64(size), ptr(out.ctypes.data), ptr(bad.ctypes.data))


def decode_carried_2bit(slots, offset, value, size, out, bad):
    """The library's hylo_decode_carried_2bit on C-contiguous numpy arrays (arguments
    checked by mxhylo.ops.decode_carried_2bit)."""
    import ctypes
    fn = _c_library().hylo_decode_carried_2bit
    fn.restype = None
    ptr = ctypes.c_void_p
    fn(ptr(slots.ctypes.data), ctypes.c_int64(slots.shape[0]), ctypes.c_int64(slots.shape[1]),
       ctypes.c_int64(offset), ptr(value.ctypes.data), ctypes.c_int64(size),
       ptr(out.ctypes.data), ptr(bad.ctypes.data))


def decode_words_2bit(data, offsets, value, size, out):
    """The library's hylo_decode_words_2bit on C-contiguous numpy arrays (arguments
    checked by mxhylo.ops.decode_gathered_2bit)."""
    import ctypes
    fn = _c_library().hylo_decode_words_2bit
    fn.restype = None
    ptr = ctypes.c_void_p
    fn(ptr(data.ctypes.data), ptr(offsets.ctypes.data), ctypes.c_int64(len(offsets)),
       ptr(value.ctypes.data), ctypes.c_int64(size), ptr(out.ctypes.data))


def decode_carried_sums(values, size, workers, value, out):
    """The library's hylo_decode_carried_sums on C-contiguous numpy arrays (arguments
    checked by mxhylo.ops.decode_carried_sums) -> the count of bad carrier values."""
    import ctypes
    fn = _c_library().hylo_decode_carried_sums
    fn.restype = ctypes.c_int64
    return int(fn(ctypes.c_void_p(values.ctypes.data), ctypes.c_int64(size),
                  ctypes.c_int64(workers), ctypes.c_float(value),
                  ctypes.c_void_p(out.ctypes.data)))


def pack_carriers(data, values):
    """The library's hylo_pack_carriers on C-contiguous numpy arrays (arguments checked
    by mxhylo.ops.pack_bytes)."""
    import ctypes
    fn = _c_library().hylo_pack_carriers
    fn.restype = None
    fn(ctypes.c_void_p(data.ctypes.data), ctypes.c_int64(len(data)),
       ctypes.c_void_p(values.ctypes.data))


def set_simd(on):
    """Use the AVX-512 row-norm kernel of select_kernels (when compiled in, the
    default) or the portable loop; returns whether AVX-512 is now in use. Both
    give bitwise the same results. For tests and the benchmark."""
    return bool(_c_library().hylo_set_simd(1 if on else 0))
