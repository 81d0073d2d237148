"""One process of a benchmark job: ``python -m mxhylo.bench.worker CONFIG.json``.

mxhylo.bench.jobs starts it in every worker of a job (on this machine also in the
scheduler and the servers, which serve inside the package's first ``import mxnet``).
It runs the config's task (comm's exchange, train's speed or tta, accuracy's digits)
and writes the result as JSON to JOB_DIR/result-RANK.json.
"""
import importlib
import json
import os
import sys
import time

TASKS = {"exchange": "comm", "speed": "train", "tta": "train", "digits": "accuracy"}


class FileSync:
    """Barriers of the job's workers and requests to the harness, through files in the
    job's sync folder (no network traffic: the same for every mode)."""

    def __init__(self, cfg, rank, poll=0.0005):
        self.dir, self.n, self.rank = cfg["sync_dir"], int(cfg["workers"]), int(rank)
        self.timeout, self.poll, self.count = float(cfg.get("timeout") or 600), poll, 0
        self.marks = cfg.get("marks", False)

    def _wait_for(self, paths, what):
        deadline = time.monotonic() + self.timeout
        while True:
            paths = [p for p in paths if not os.path.exists(p)]
            if not paths:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("rank %d: %s not reached within %.0f s (missing %s)" % (
                    self.rank, what, self.timeout, ", ".join(map(os.path.basename, paths))))
            time.sleep(self.poll)

    def barrier(self, tag=""):
        """Returns once every worker has called barrier as many times."""
        self.count += 1
        name = os.path.join(self.dir, "barrier%04d%s" % (self.count, tag))
        open("%s.%d" % (name, self.rank), "w").close()
        self._wait_for(["%s.%d" % (name, i) for i in range(self.n)], "barrier " + name)

    def mark(self, name):
        """All workers: a barrier, then rank 0 has the harness read the counters (in the
        emulated cluster), then a barrier."""
        self.barrier("-" + name)
        if self.rank == 0 and self.marks:
            path = os.path.join(self.dir, "mark-" + name)
            with open(path + ".tmp", "w") as f:
                f.write("%.6f\n" % time.time())
            os.rename(path + ".tmp", path)
            self._wait_for([path + ".ack"], "the harness's reading at " + name)
        self.barrier("-" + name + "-done")


def jsonable(obj):
    """kv.stats() and plans hold numpy values, tuples, objects: made JSON."""
    import numpy as np
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return jsonable(vars(obj)) if hasattr(obj, "__dict__") else repr(obj)


def stats(kv):
    return jsonable(kv.stats()) if hasattr(kv, "stats") else None


def steady(kv):
    """Whether a store is past its start-up: a hylo store's dense warm-up over and its
    route settled (or, with no Trainer, a first exchange made); other stores always."""
    s = kv.stats() if hasattr(kv, "stats") else None
    if not s or "warming_up" not in s:
        return True
    route = s.get("route")
    return not s["warming_up"] and (route.get("settled", True) if route
                                    else bool(s.get("layers")))


MAX_STARTUP_STEPS = 1000


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cfg = json.load(f)
    if cfg.get("rendezvous_ready"):
        # Horovod in the emulated cluster: Horovod 0.28 finds its Gloo device from the
        # host name, which must be this namespace's address, not the machine's
        import socket
        socket.sethostname(os.environ["HOROVOD_HOSTNAME"])
        FileSync(cfg, -1)._wait_for([cfg["rendezvous_ready"]], "the rendezvous server")
    module = importlib.import_module("mxhylo.bench." + TASKS[cfg["task"]])
    result = getattr(module, cfg["task"] + "_worker")(cfg)
    path = os.path.join(cfg["job_dir"], "result-%d.json" % result["rank"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
