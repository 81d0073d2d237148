"""The README's quick start, copied out of the README and run as users run it: under
``python -m mxhylo.launch -n 2 -s 1`` and under MXNet's own launcher. It must train (a
DataLoader's default last batch, smaller than the others, included) and print its
stats."""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = 240


def quick_start():
    """The README's first python block (the quick start)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_quick_start_trains_and_prints_its_stats(tmp_path):
    script = tmp_path / "quick.py"
    script.write_text(quick_start())
    proc = subprocess.run(
        [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
         str(TIMEOUT_S), sys.executable, str(script)],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S + 60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    last = {int(rank): float(acc) for rank, acc in
            re.findall(r"rank (\d), epoch 7: test accuracy ([0-9.]+)", out)}
    assert sorted(last) == [0, 1], out[-3000:]
    assert min(last.values()) >= 0.9, last
    assert len(re.findall(r"rank \d: pushed [0-9.]+ MB where dense float32 pushes", out)) == 2
    # the plan: the large layer 2-bit where the cost model predicts that pays on these
    # links (else dense, and the servers' route), the small ones always dense
    assert re.search(r"dense0_weight +512x1152 +589824 +(fc_2bit|none) ", out), out[-3000:]
    assert re.search(r"conv0_weight +32x1x3x3 +288 +none .*below size_threshold", out), \
        out[-3000:]
    assert re.search(r"route: (servers|workers) \(", out), out[-3000:]


# dmlc-tracker's local launcher, as MXNet's tools/launch.py calls it (``launch.py -n 2
# -s 1 python quick.py``), with the one shim Python 3.9+ needs: it still calls
# Thread.isAlive().
MXNET_LAUNCHER = """
import sys, threading
from dmlc_tracker import local, tracker
class Thread(threading.Thread):
    isAlive = threading.Thread.is_alive
tracker.Thread = Thread
class Args:
    num_workers, num_servers, local_num_attempt = 2, 1, 0
    command = sys.argv[1:]
local.submit(Args)
"""


def test_the_quick_start_under_mxnets_own_launcher(tmp_path):
    """The same script started the way MXNet's tools/launch.py starts a job: it trains
    and prints its stats on both workers; every process ends (its process group is
    killed if the job outlives its bound)."""
    import os
    import signal
    script = tmp_path / "quick.py"
    script.write_text(quick_start())
    launcher = tmp_path / "mxnet_launch.py"
    launcher.write_text(MXNET_LAUNCHER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DMLC_ROLE", None)
    proc = subprocess.Popen([sys.executable, str(launcher), sys.executable, str(script)],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # what is left of the job, if anything
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, out[-3000:]
    last = re.findall(r"rank (\d), epoch 7: test accuracy ([0-9.]+)", out)
    assert sorted(int(r) for r, _ in last) == [0, 1], out[-3000:]
    assert min(float(a) for _, a in last) >= 0.9, last
    assert len(re.findall(r"rank \d: pushed [0-9.]+ MB where dense float32 pushes", out)) == 2
