"""Horovod's own HTTP rendezvous server for one job of the emulated cluster.

``python -I rendezvous.py PORT HOSTS READY RESULT...``: serves horovodrun's
RendezvousHTTPServer on PORT, initialised with horovodrun's slot plan of HOSTS (one
comma-separated entry per rank), writes READY once it listens, and exits once every
RESULT file exists (the workers need it only while hvd.init connects them). Run by
path and isolated: it imports neither mxhylo nor mxnet.
"""
import collections
import os
import sys
import threading
import time


def hosts_arg(hosts):
    """horovodrun's -H form of a rank-ordered host list: 'a:2,b:1'."""
    return ",".join("%s:%d" % kv for kv in collections.Counter(hosts).items())


def serve(port, hosts, ready, results, timeout=24 * 3600.0, poll=0.05):
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    httpd = RendezvousHTTPServer(("", int(port)), RendezvousHandler, 0)
    httpd.init(get_host_assignments(parse_hosts(hosts_arg(hosts)), len(hosts)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    with open(ready + ".tmp", "w") as f:
        f.write("%d\n" % int(port))
    os.rename(ready + ".tmp", ready)
    deadline = time.monotonic() + timeout
    try:
        while not all(os.path.exists(p) for p in results):
            if time.monotonic() > deadline:
                return 1
            time.sleep(poll)
    finally:
        httpd.shutdown()
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4:]))
