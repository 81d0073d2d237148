"""bench train: its options, its step and time-to-accuracy maths, one small run in the
emulated cluster and a SIGTERM mid-run (root)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mxhylo.bench import netns, train

needs_netns = pytest.mark.skipif(not netns.namespaces_usable(),
                                 reason="needs root and iproute2 (network namespaces)")


def _args(argv=()):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (["--modes", "dist_sync,horovod"], "unknown mode horovod"),
    (["--rate", "fast"], "not a rate"),
    (["--hylo-options", "[1]"], "JSON object"),
    (["--models", "vgg16", "--image-size", "64"], "vgg16 needs --image-size 224"),
    (["--modes", "hylo_dynamic"], "--tta only"),
    (["--tta", "--rate", "1gbit,none"], "one --rate"),
    (["--tta", "--target", "95"], "accuracy in"),
])
def test_bad_options_say_why(argv, message):
    with pytest.raises(ValueError, match=message):
        train.check_args(_args(argv))


def _round(step, fwd_bwd, exchange, cpu=(1.0, 0.5)):
    return {"full": {"seconds": step, "cpu_s": cpu[0]},
            "split": {"fwd_bwd_s": fwd_bwd, "fwd_bwd_cpu_s": cpu[1], "exchange_s": exchange}}


def _worker(rank, rounds, sha="abc"):
    return {"rank": rank, "rounds": rounds, "warmup": [], "stream": {"steps": 4, "seconds": 6.0},
            "setup_s": 1.0, "store_s": 0.1, "first_step_s": 2.0, "startup_steps": 1,
            "plan": None, "update_on_kvstore": False, "stats": None, "param_sha256": sha,
            "peak_rss_bytes": 1 << 30}


def test_step_figures_are_medians_of_the_slowest_worker():
    w0 = [_round(2.0, 0.5, 1.7), _round(2.2, 0.6, 1.8), _round(2.1, 0.5, 1.6, cpu=(9, 0.5))]
    w1 = [_round(2.4, 0.7, 1.6), _round(2.0, 0.5, 2.0), _round(2.3, 0.6, 1.7)]
    counters = {"start": {"worker0": (0, 0), "worker1": (0, 0), "server0": (0, 0)},
                "end": {"worker0": (600, 1200), "worker1": (600, 1200), "server0": (0, 0)}}
    cpu = {"start": {"server 0": 5.0, "worker 0": 0.0}, "end": {"server 0": 8.0, "worker 0": 50}}
    r = train.summarise_speed([_worker(0, w0), _worker(1, w1)], counters, cpu, steps=3)
    # slowest per round: steps 2.4, 2.2, 2.3; fwd_bwd 0.7, 0.6, 0.6; exchange 1.7, 2.0, 1.7
    assert (r["step_s"], r["fwd_bwd_s"], r["exchange_s"]) == pytest.approx((2.3, 0.6, 1.7))
    assert r["overlap_s"] == pytest.approx(0.6 + 1.7 - 2.3)
    assert r["stream_step_s"] == pytest.approx(1.5)
    assert r["wire"]["push_bytes_per_step"] == pytest.approx(1200 / 6)   # 6 exchanges
    # the exchange's CPU: median full step minus median fwd+bwd, per worker; servers'
    # CPU over the window per exchange
    assert r["exchange_cpu"]["per_worker_s"] == pytest.approx([0.5, 0.5])
    assert r["exchange_cpu"]["servers_s"] == pytest.approx(3.0 / 6)
    assert r["workers_identical"]
    assert not train.summarise_speed([_worker(0, w0, "a"), _worker(1, w1, "b")], {}, {},
                                     3)["workers_identical"]


def _tta(mode_speed, accs, seed):
    history = [{"epoch": i + 1, "steps": 10 * (i + 1), "updates": 10 * (i + 1),
                "train_s": mode_speed * (i + 1), "wall_s": (mode_speed + 1) * (i + 1),
                "accuracy": a} for i, a in enumerate(accs)]
    return train.summarise_tta_run(
        [dict(_worker(0, []), seed=seed, history=history, steps_per_epoch=10),
         dict(_worker(1, []), seed=seed, history=[], steps_per_epoch=10)], 0.95)


def test_time_to_accuracy_pairs_seeds_and_names_the_best_peer():
    runs = {"dist_sync": [_tta(10.0, [0.9, 0.96, 0.97], 0), _tta(10.0, [0.9, 0.94, 0.96], 1)],
            "dist_sync_fp16": [_tta(5.0, [0.9, 0.97], 0)],
            "hylo": [_tta(4.0, [0.8, 0.95, 0.965], 0), _tta(4.0, [0.9, 0.9, 0.94], 1),
                     {"status": "failed: x", "seed": 2}]}
    assert runs["hylo"][1]["time_to_target"] is None
    assert runs["dist_sync"][1]["time_to_target"]["epochs"] == 3
    s = train.summarise_tta(runs)
    assert (s["hylo"]["runs"], s["hylo"]["ok"], s["hylo"]["reached"]) == (3, 2, 1)
    assert s["dist_sync"]["time_to_target_median_s"] == pytest.approx(25.0)
    assert s["hylo"]["time_to_target_speedup_vs_dist_sync"] == pytest.approx(25.0 / 8.0)
    assert s["hylo"]["time_to_target_best_peer"] == "dist_sync_fp16"
    assert s["hylo"]["time_to_target_speedup_vs_best_peer"] == pytest.approx(10.0 / 8.0)
    gap = s["hylo"]["paired_gap_points"]          # seed 0: -0.5 point, seed 1: -2.0
    assert gap["vs"] == "dist_sync" and gap["n"] == 2
    assert gap["mean"] == pytest.approx(-1.25) and gap["worst"] == pytest.approx(-2.0)
    assert any("not hit" in l for l in train.tta_table({"runs": runs, "summary": s}))


def test_the_tta_plot_shows_the_batch_each_update_took(tmp_path):
    """k doubles at each --tta-batch-schedule epoch for a *_dynamic mode only; the plot
    gets its panel and is written."""
    cfg = {"tta_batch_size": 32, "workers": 4, "batch_schedule": [2.0, 4.0], "momentum": 0.9,
           "target": 0.95, "tta_model": "m", "tta_size": 16, "servers": 2, "rate": "1gbit"}
    run = _tta(4.0, [0.5, 0.9, 0.96, 0.97, 0.97], 0)
    assert train.update_batches("hylo_dynamic", run, cfg) == [128, 128, 256, 256, 512]
    assert train.update_batches("hylo", run, cfg) == [128] * 5
    out = {"config": dict(cfg, task="tta"), "machine": {}, "suite": "train",
           "runs": {"hylo": [run], "hylo_dynamic": [run]}}
    train.plot(out, str(tmp_path / "tta.png"))
    assert (tmp_path / "tta.png").read_bytes()[:4] == b"\x89PNG"


# default run: the harness's arithmetic and checks above; its jobs: --runslow
@pytest.mark.slow
@needs_netns
def test_train_run_steps_every_mode_and_the_workers_agree(tmp_path):
    """bench train in the emulated cluster, 2 workers and 1 server: dist_sync_fp16 (float16
    gradients both ways, the update on the workers) and hylo_workers (compressed)."""
    from mxhylo.bench.__main__ import main
    path = tmp_path / "train.json"
    main(["train", "-n", "2", "-s", "1", "--models", "cifar_resnet20_v1", "--image-size",
          "16", "--classes", "10", "--modes", "dist_sync_fp16,hylo_workers", "--steps", "1",
          "--warmup", "0", "--stream-steps", "1", "--timeout", "120",
          "--hylo-options", '{"warmup_steps": 0}', "--json", str(path)])
    out = json.loads(path.read_text())
    assert netns.own_namespaces("mxhcomm%d-" % os.getpid()) == []
    per_mode = out["results"]["cifar_resnet20_v1"]
    for m, r in per_mode.items():
        assert r["status"] == "ok", r.get("log_tail", r["status"])
        assert r["step_s"] > 0 and r["fwd_bwd_s"] > 0 and r["exchange_s"] > 0
        assert r["workers_identical"], r["param_sha256"]
        assert r["update_on_kvstore"] is False
    dense = out["models"]["cifar_resnet20_v1"]["dense_bytes"]
    half, hylo = per_mode["dist_sync_fp16"], per_mode["hylo_workers"]
    for way in ("push_bytes_per_step", "pull_bytes_per_step"):      # 2 workers, float16
        assert dense <= half["wire"][way] < 1.2 * dense, way
    assert hylo["hylo"]["bytes_pushed_per_step"] < 0.5 * hylo["hylo"]["dense_bytes_per_step"]
    assert hylo["wire"]["push_bytes_per_step"] < half["wire"]["push_bytes_per_step"]
    assert half["exchange_cpu"]["servers_s"] > 0
    assert half["speedup_vs_best_peer"] == pytest.approx(1.0)
    assert (tmp_path / "train.png").read_bytes()[:4] == b"\x89PNG"


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _descendants(root):
    parents = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open("/proc/%d/stat" % pid) as f:
                parents[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        out += kids
        todo += kids
    return out


@pytest.mark.slow
@needs_netns
def test_sigterm_mid_run_removes_every_namespace_and_process():
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxhylo.bench", "train", "-n", "2", "-s", "1", "--models",
         "cifar_resnet20_v1", "--image-size", "16", "--classes", "10", "--modes", "hylo",
         "--steps", "50", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = "mxhcomm%d-" % proc.pid
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                "mxhylo.bench.worker" in _cmdline(p) for p in _descendants(proc.pid)):
            time.sleep(0.2)
        assert netns.own_namespaces(prefix), "the run never started its workers"
        job = [p for p in _descendants(proc.pid) if "mxnet" in _cmdline(p)
               or "mxhylo" in _cmdline(p)]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-2000:]
    assert netns.own_namespaces(prefix) == [], out[-2000:]
    assert job and [p for p in job if "mxnet" in _cmdline(p) or "mxhylo" in _cmdline(p)] == []
