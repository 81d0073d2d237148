"""The README's quick start, copied out of the README and run as a user runs it:
under ``python -m mxhylo.launch -n 2 -s 1``. It must train (a DataLoader's default
last batch, smaller than the others, included) and print its stats."""
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
