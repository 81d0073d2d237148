"""The train benchmark's harness: option checks, the step/overlap/speedup and
time-to-accuracy maths, job commands, counter marks, tables and plots; as root, one
short real run of a tiny model (2 workers, 1 server) and a SIGTERM mid-run."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mxhylo.bench import comm, jobs, netns, train, train_worker


def _args(argv=()):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


# ----------------------------------------------------------------------------- options

def test_defaults_are_the_issue_setup():
    args = _args()
    parsed = train.check_args(args)
    assert (args.workers, args.servers, args.rate) == (4, 2, "1gbit")
    assert parsed["models"] == ["resnet50_v1b"] and parsed["image_sizes"] == {"resnet50_v1b": 64}
    assert parsed["modes"] == ["dist_sync", "dist_sync_fp16", "hylo_densepull", "hylo"]
    assert args.batch_size == 8 and args.momentum == 0.9 and parsed["rate_bps"] == 1e9
    assert args.seeds == 3 and args.target == 0.95 and not args.tta


def test_image_size_per_model():
    assert train.image_size_for("vgg16") == 224
    assert train.image_size_for("alexnet") == 224
    assert train.image_size_for("resnet50_v1b") == 64
    assert train.image_size_for("resnet50_v1b", 96) == 96
    parsed = train.check_args(_args(["--models", "resnet50_v1b,vgg16,alexnet"]))
    assert parsed["image_sizes"] == {"resnet50_v1b": 64, "vgg16": 224, "alexnet": 224}
    with pytest.raises(ValueError, match="vgg16 needs --image-size 224"):
        train.check_args(_args(["--models", "vgg16", "--image-size", "64"]))


@pytest.mark.parametrize("argv,message", [
    (["--modes", "dist_sync,horovod"], "unknown mode horovod"),
    (["--modes", "hylo,hylo"], "twice"),
    (["--rate", "fast"], "not a rate"),
    (["--hylo-options", "{bad"], "not JSON"),
    (["--hylo-options", "[1]"], "JSON object"),
    (["-n", "0"], "at least one worker"),
    (["--steps", "0"], "--steps"),
    (["--tta", "--target", "95"], "accuracy in"),
    (["--tta", "--seeds", "0"], "--seeds"),
])
def test_bad_options_say_why(argv, message):
    with pytest.raises(ValueError, match=message):
        train.check_args(_args(argv))


def test_run_reports_bad_options_before_anything(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        train.run(_args(["--modes", "nope"]))
    assert "unknown mode nope" in str(exc.value.code)


def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exc:
        train.run(_args([]))
    assert "needs root" in str(exc.value.code) and "this benchmark" in str(exc.value.code)


def test_every_mode_has_a_kvstore_recipe():
    assert set(train.DEFAULT_MODES) <= set(train_worker.MODES)
    assert train_worker.HyloDensePull.options == {"compress_pull": False}
    assert train_worker.HyloMode.options == {}        # the library's defaults
    for cls in train_worker.MODES.values():
        assert cls.description


def test_registered_as_bench_suite():
    from mxhylo.bench import __main__ as bench_main
    assert "train" in bench_main.SUITES


# ----------------------------------------------------------------------------- maths

def _round(step, fwd_bwd, exchange, cpu=None):
    """One timed round; cpu: (full step's CPU s, forward+backward's CPU s) or None."""
    r = {"full": {"seconds": step, "fwd_bwd_call_s": 0.01, "step_call_s": step - 0.2,
                  "wait_s": 0.19},
         "split": {"fwd_bwd_s": fwd_bwd, "exchange_s": exchange,
                   "exchange_call_s": exchange / 2}}
    if cpu:
        r["full"]["cpu_s"], r["split"]["fwd_bwd_cpu_s"] = cpu
    return r


def _worker(index, rounds, sha="abc", stats=None, stats_before=None):
    return {"index": index, "rank": index, "setup_s": 3.0 + index, "update_on_kvstore": False,
            "warmup": [_round(9.0, 1.0, 1.0)], "rounds": rounds,
            "stream": {"steps": 4, "seconds": 4.0 * (1.5 + index)},
            "param_sha256": sha, "param_abs_sum": 1.5,
            "stats": stats, "stats_before": stats_before}


def test_spread_and_overlap():
    s = train.spread([3.0, 1.0, 2.0, None])
    assert (s["min"], s["median"], s["max"], s["n"]) == (1.0, 2.0, 3.0, 3)
    assert train.spread([]) is None
    assert train.overlap(0.6, 2.0, 2.3) == pytest.approx(0.3)
    assert train.overlap(0.6, 2.0, 2.6) == pytest.approx(0.0)


def test_summarise_speed_slowest_worker_medians_and_bytes():
    w0 = [_round(2.0, 0.5, 1.7), _round(2.2, 0.6, 1.8), _round(2.1, 0.5, 1.6)]
    w1 = [_round(2.4, 0.7, 1.6), _round(2.0, 0.5, 2.0), _round(2.3, 0.6, 1.7)]
    before = {"worker0": (0, 0), "worker1": (0, 0), "server0": (0, 0)}
    after = {"worker0": (600, 1200), "worker1": (600, 1200), "server0": (2400, 1200)}
    stats_b = {"steps": 2, "bytes_pushed": 100, "timing": {"encode": 0.1}}
    stats_a = {"steps": 8, "bytes_pushed": 700, "timing": {"encode": 0.25}}
    res = train.summarise_speed([_worker(0, w0, stats=stats_a, stats_before=stats_b),
                                 _worker(1, w1, stats=stats_a, stats_before=stats_b)],
                                before, after, steps=3)
    # slowest per round: steps 2.4, 2.2, 2.3; fwd_bwd 0.7, 0.6, 0.6; exchange 1.7, 2.0, 1.7
    assert res["step_s"] == pytest.approx(2.3)
    assert (res["step"]["min"], res["step"]["max"]) == (pytest.approx(2.2), pytest.approx(2.4))
    assert res["fwd_bwd_s"] == pytest.approx(0.6)
    assert res["exchange_s"] == pytest.approx(1.7)
    assert res["overlap_s"] == pytest.approx(0.6 + 1.7 - 2.3)
    assert res["overlap_fraction_of_exchange"] == pytest.approx(0.0 / 1.7, abs=1e-9)
    assert res["step_over_fwd_bwd"] == pytest.approx(2.3 / 0.6)
    assert res["stream_step_s"] == pytest.approx(2.5)          # the slower worker's
    assert res["setup_s"] == 4.0 and res["warmup_step_s"] == [9.0]
    # 3 rounds = 6 exchanges in the counter window
    assert res["wire"]["push_bytes_per_step"] == pytest.approx(1200 / 6)
    assert res["wire"]["pull_bytes_per_step"] == pytest.approx(2400 / 6)
    assert res["hylo"]["bytes_pushed_per_step"] == pytest.approx(2 * 600 / 6)
    # cumulative averages to the window's own: (0.25 * 8 - 0.1 * 2) / 6
    assert res["hylo"]["timing_per_exchange_s"][0]["encode"] == pytest.approx(0.3)
    assert res["workers_identical"] is True


def test_exchange_cpu_is_the_step_minus_forward_backward_plus_the_servers():
    """Workers: median full-step CPU minus median forward+backward CPU, each worker,
    summed; servers: their CPU over the window per exchange, summed (not the
    scheduler's, not the workers' window totals)."""
    w0 = [_round(2, 1, 1, cpu=(3.0, 1.0)), _round(2, 1, 1, cpu=(3.4, 1.2)),
          _round(2, 1, 1, cpu=(9.0, 1.1))]                  # medians 3.4 and 1.1
    w1 = [_round(2, 1, 1, cpu=(2.0, 1.0))] * 3
    before = {"worker 0": 10.0, "server 0": 5.0, "server 1": 7.0, "scheduler": 0.0}
    after = {"worker 0": 99.0, "server 0": 8.0, "server 1": 10.0, "scheduler": 9.0}
    res = train.summarise_speed([_worker(0, w0), _worker(1, w1)], None, None, 3,
                                before, after)
    cpu = res["exchange_cpu"]
    assert cpu["per_worker_s"] == [pytest.approx(2.3), pytest.approx(1.0)]
    assert cpu["workers_s"] == pytest.approx(3.3)
    assert cpu["servers_s"] == pytest.approx(6.0 / 6)      # 3 rounds = 6 exchanges
    assert cpu["total_s"] == pytest.approx(4.3)
    horovod = train.summarise_speed([_worker(0, w1)], None, None, 3, {}, {})
    assert horovod["exchange_cpu"]["servers_s"] == 0.0
    old = train.summarise_speed([_worker(0, [_round(2, 1, 1)])], None, None, 1)
    assert old["exchange_cpu"] is None                      # results without CPU readings


def test_group_cpu_seconds_counts_a_busy_child_and_its_own_children(tmp_path):
    """The harness's CPU reading of a job's role: every process of its group."""
    import subprocess
    import sys
    import time
    from mxhylo.bench import jobs
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', %r])\n" % busy + busy +
            "c.wait()\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        seconds = 0.0
        while time.monotonic() < deadline and seconds < 0.5:
            time.sleep(0.2)
            seconds = jobs.group_cpu_seconds(proc.pid)
        # the parent's 0.5 s at least (a reaped child's time is the parent's
        # cumulative, not counted: a role's processes live as long as the role)
        assert 0.5 <= seconds < 5.0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_checksums_that_differ_are_reported():
    rounds = [_round(1.0, 0.5, 0.5)]
    res = train.summarise_speed([_worker(0, rounds, sha="a"), _worker(1, rounds, sha="b")],
                                None, None, steps=1)
    assert res["workers_identical"] is False and res["param_sha256"] == ["a", "b"]
    assert "wire" not in res and "hylo" not in res


def test_speedups_against_dist_sync():
    per_mode = {"dist_sync": {"status": "ok", "step_s": 2.4, "stream_step_s": 2.0},
                "hylo": {"status": "ok", "step_s": 0.8, "stream_step_s": 0.5},
                "hylo_densepull": {"status": "failed: boom"}}
    train.add_speedups(per_mode)
    assert per_mode["dist_sync"]["speedup_vs_dist_sync"] == pytest.approx(1.0)
    assert per_mode["hylo"]["speedup_vs_dist_sync"] == pytest.approx(3.0)
    assert per_mode["hylo"]["stream_speedup_vs_dist_sync"] == pytest.approx(4.0)
    assert "speedup_vs_dist_sync" not in per_mode["hylo_densepull"]
    alone = train.add_speedups({"hylo": {"status": "ok", "step_s": 1.0}})
    assert alone["hylo"]["speedup_vs_dist_sync"] is None


def test_speedups_against_the_best_peer(tmp_path):
    """Step speedups are stated against the fastest non-hylo mode of the run too (the
    table's 'vs peer' column, a best-peer line, the plot's labels)."""
    rounds = {m: [_round(step, 0.5, step - 0.2)] for m, step in (
        ("dist_sync", 2.4), ("dist_sync_fp16", 1.6), ("horovod_fp16", 2.0), ("hylo", 0.8))}
    per_mode = {m: train.summarise_speed([_worker(0, r), _worker(1, r)], None, None, 1)
                for m, r in rounds.items()}
    per_mode["horovod_dense"] = {"status": "failed: boom"}
    train.add_speedups(per_mode)
    train.add_best_peer(per_mode)
    assert per_mode["hylo"]["best_peer"] == "dist_sync_fp16"
    assert per_mode["hylo"]["speedup_vs_best_peer"] == pytest.approx(2.0)
    assert per_mode["hylo"]["speedup_vs_dist_sync"] == pytest.approx(3.0)
    assert per_mode["dist_sync"]["speedup_vs_best_peer"] == pytest.approx(1.6 / 2.4)
    assert "best_peer" not in per_mode["horovod_dense"]
    report = {"results": {"m": per_mode},
              "config": {"modes": list(per_mode), "image_sizes": {"m": 64},
                         "batch_size": 8, "workers": 2, "servers": 1, "rate": "1gbit"},
              "machine": {"cpu": "X"}, "date": "2026-01-01T00:00:00"}
    lines = train.format_speed_table(report)
    assert lines[0].split()[8:14] == ["CPU", "s", "w+s", "speedup", "vs", "peer"]
    row = [l for l in lines if l.split()[1:2] == ["hylo"]][0].split()
    assert row[7:10] == ["-", "3.00x", "2.00x"]
    best = [l for l in lines if "best peer" in l][0]
    assert "dist_sync_fp16, step 1.600 s" in best and "hylo 2.00x" in best
    train.write_speed_plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def _history(accs, per_epoch=10.0, eval_s=1.0, steps=10):
    return [{"epoch": i + 1, "steps": steps * (i + 1), "train_s": per_epoch * (i + 1),
             "wall_s": (per_epoch + eval_s) * (i + 1), "accuracy": a}
            for i, a in enumerate(accs)]


def test_time_to_target_is_the_first_evaluation_at_or_above():
    h = _history([0.5, 0.95, 0.9, 0.97])
    t = train.time_to_target(h, 0.95)
    assert (t["epochs"], t["steps"], t["train_s"], t["wall_s"]) == (2, 20, 20.0, 22.0)
    assert train.time_to_target(h, 0.98) is None


def test_tta_summaries():
    def run(mode_speed, accs, seed, sha="x"):
        return [{"index": i, "rank": i, "seed": seed, "setup_s": 1.0,
                 "history": _history(accs, per_epoch=mode_speed) if i == 0 else [],
                 "steps_per_epoch": 10, "update_on_kvstore": False, "stats": None,
                 "param_sha256": sha, "param_abs_sum": 1.0} for i in range(2)]
    runs = {"dist_sync": [train.summarise_tta_run(run(10.0, [0.9, 0.96, 0.97], 0), 0.95),
                          train.summarise_tta_run(run(10.0, [0.9, 0.94, 0.96], 1), 0.95)],
            "hylo": [train.summarise_tta_run(run(4.0, [0.8, 0.95, 0.965], 0), 0.95),
                     train.summarise_tta_run(run(4.0, [0.9, 0.9, 0.94], 1), 0.95),
                     {"status": "failed: x", "seed": 2}]}
    assert runs["dist_sync"][1]["time_to_target"]["epochs"] == 3
    assert runs["hylo"][1]["time_to_target"] is None
    assert runs["hylo"][0]["final_accuracy"] == 0.965 and runs["hylo"][0]["workers_identical"]
    s = train.summarise_tta(runs)
    assert s["dist_sync"]["reached"] == 2 and s["hylo"]["reached"] == 1
    assert s["hylo"]["runs"] == 3 and s["hylo"]["ok"] == 2
    assert s["dist_sync"]["time_to_target_s"]["median"] == pytest.approx(25.0)
    assert s["hylo"]["time_to_target_s"]["median"] == pytest.approx(8.0)
    assert s["hylo"]["time_to_target_speedup_vs_dist_sync"] == pytest.approx(25.0 / 8.0)
    assert s["dist_sync"]["final_accuracy"]["mean"] == pytest.approx(0.965)
    assert s["hylo"]["accuracy_gap_points"] == pytest.approx(100 * (0.9525 - 0.965))
    # the best peer (only dist_sync here) and hylo's speedup over it
    assert s["hylo"]["best_peer"] == "dist_sync"
    assert s["hylo"]["time_to_target_speedup_vs_best_peer"] == pytest.approx(25.0 / 8.0)
    report = {"runs": runs, "summary": s}
    lines = train.format_tta_table(report)
    assert any("not hit" in l for l in lines) and any("failed: x" in l for l in lines)
    assert any(l.startswith("hylo ") and "vs the best peer (dist_sync)" in l for l in lines)
    runs["dist_sync_fp16"] = [train.summarise_tta_run(run(5.0, [0.9, 0.97], 0), 0.95)]
    s = train.summarise_tta(runs)
    assert s["hylo"]["best_peer"] == "dist_sync_fp16"
    assert s["hylo"]["time_to_target_speedup_vs_best_peer"] == pytest.approx(10.0 / 8.0)
    assert s["hylo"]["time_to_target_speedup_vs_dist_sync"] == pytest.approx(25.0 / 8.0)
    # paired by seed: hylo seed 0 -0.5 point, seed 1 -2.0 points against dist_sync
    gap = s["hylo"]["paired_gap_points"]
    assert (gap["vs"], gap["n"]) == ("dist_sync", 2)
    assert gap["mean"] == pytest.approx(-1.25) and gap["worst"] == pytest.approx(-2.0)
    assert "paired_gap_points" not in s["dist_sync"]
    # a dynamic mode: against its fixed twin too, and its exchanges counted
    dyn = run(3.0, [0.9, 0.96, 0.97], 0)
    for h, updates in zip(dyn[0]["history"], (10, 15, 18)):
        h["updates"] = updates
    runs["hylo_dynamic"] = [train.summarise_tta_run(dyn, 0.95)]
    assert runs["hylo_dynamic"][0]["updates_per_epoch"] == [10, 5, 3]
    s = train.summarise_tta(runs)
    d = s["hylo_dynamic"]
    assert d["updates"] == 18
    assert d["paired_gap_vs_fixed_points"]["vs"] == "hylo"
    assert d["paired_gap_vs_fixed_points"]["mean"] == pytest.approx(0.5)
    assert d["time_to_target_speedup_vs_fixed"] == pytest.approx(8.0 / 6.0)
    lines = train.format_tta_table({"runs": runs, "summary": s})
    assert any("paired final accuracy vs hylo +0.50" in l for l in lines), lines


def test_steps_per_epoch_uses_the_smallest_part():
    assert train.steps_per_epoch(1348, 4, 32) == 10          # parts of 337
    assert train.steps_per_epoch(1348, 2, 64) == 10          # parts of 674
    assert train.steps_per_epoch(9, 4, 1) == 0               # parts 3, 3, 3, 0


def test_store_is_steady_once_its_route_is_settled_and_warm_up_done():
    class Plain:
        pass

    class Hylo:
        def __init__(self, route, warming_up):
            self.route, self.warming = route, warming_up

        def stats(self):
            return {"steps": 7, "route": self.route, "warming_up": self.warming}
    settled, on_trial = {"route": "workers", "settled": True}, {"route": "servers",
                                                                 "settled": False}
    assert train_worker.store_steady(Plain())
    assert not train_worker.store_steady(Hylo(None, False))        # before its first step
    assert not train_worker.store_steady(Hylo(on_trial, False))
    assert not train_worker.store_steady(Hylo(settled, True))
    assert train_worker.store_steady(Hylo(settled, False))


def test_lr_schedule_reaches_the_servers():
    """A schedule set with Trainer.set_learning_rate would stay on the workers while
    dist_sync's servers update: the worker passes it as the optimizer's lr_scheduler."""
    import mxnet as mx
    net = mx.gluon.nn.Dense(2)
    net.initialize()
    sched = mx.lr_scheduler.CosineScheduler(max_update=10, base_lr=0.1, final_lr=0.0)

    class Local(train_worker.Mode):
        def kvstore(self, cfg):
            return None, None
    train_worker.MODES["_local"] = Local
    try:
        _, trainer = train_worker.make_trainer({"mode": "_local", "momentum": 0.9,
                                                "wd": 0.0}, net, 0.1, lr_scheduler=sched)
    finally:
        del train_worker.MODES["_local"]
    assert trainer._optimizer.lr_scheduler is sched
    assert sched(5) == pytest.approx(0.05)


def test_cpu_features_like_grep():
    text = ("flags\t: fpu sse2 avx avx2 f16c avx512f avx512dq avx512_vnni avx512bw\n"
            "flags\t: fpu avx2 f16c avx512f\nmodel name\t: X\n")
    assert comm.cpu_features(text) == ["avx2", "avx512_vnni", "avx512bw", "avx512dq",
                                        "avx512f", "f16c"]
    assert comm.cpu_features("flags: sse2 avx\n") == []
    for report in (train.machine_report(), comm.machine_info()):
        assert "cpu_features" in report and "cpus" in report
        assert report["ops_isa"] == (os.environ.get("MXHYLO_ISA") or "native")


# ----------------------------------------------------------------------------- jobs

def test_job_children_commands_and_environment(tmp_path):
    topo = netns.Topology(["scheduler", "server0", "worker0", "worker1"], 1e9, tag="t")
    children = jobs.job_children(topo, 2, 1, 9123, "/c.json", str(tmp_path),
                                 "mxhylo.bench.train_worker", worker_threads=1, python="/py")
    names = [c.name for c in children]
    assert names == ["scheduler", "server 0", "worker 0", "worker 1"]
    roles = [c.role for c in children]
    assert roles == ["scheduler", "server", "worker", "worker"]
    for c, role in zip(children, topo.roles):
        assert c.argv[:4] == ["ip", "netns", "exec", topo.ns(role)]
        assert c.env["DMLC_PS_ROOT_URI"] == topo.addr("scheduler")
        assert c.env["DMLC_PS_ROOT_PORT"] == "9123"
        assert c.env["DMLC_NUM_WORKER"] == "2" and c.env["DMLC_NUM_SERVER"] == "1"
        assert c.env["DMLC_NODE_HOST"] == topo.addr(role)
        assert c.env["DMLC_ROLE"] == c.role
    sched, server, w0, w1 = children
    assert sched.argv[4:] == ["/py", "-c", "import mxnet"]
    assert server.env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS", "1")
    assert w1.argv[4:] == ["/py", "-m", "mxhylo.bench.train_worker", "--config", "/c.json",
                           "--index", "1", "--out", str(tmp_path / "worker1.json")]
    assert w0.env["OMP_NUM_THREADS"] == "1"
    # DMLC_* of the harness's own environment never leak into a child
    assert "DMLC_TASK_ID" not in w0.env
    free = jobs.job_children(topo, 2, 1, 9123, "/c.json", str(tmp_path),
                             "mxhylo.bench.comm_worker", worker_threads=0)
    assert free[2].env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
    assert free[3].argv[4:7] == [sys.executable, "-m", "mxhylo.bench.comm_worker"]


def test_counter_marks_are_answered(tmp_path):
    class FakeTopo:
        calls = 0

        def all_counters(self):
            FakeTopo.calls += 1
            return {"worker0": (FakeTopo.calls, 2)}
    job = jobs.NetnsJob([], FakeTopo(), str(tmp_path))
    (tmp_path / "mark-start").write_text("1\n")
    (tmp_path / "mark-end.tmp").write_text("1\n")        # not yet renamed: ignored
    job._serve_marks()
    job._serve_marks()                                   # answered once
    assert (tmp_path / "mark-start.ack").exists()
    assert not (tmp_path / "mark-end.tmp.ack").exists()
    assert job.counters == {"start": {"worker0": (1, 2)}}


def test_timeouts_grow_with_the_model():
    small = {"dense_pull_floor_s": 0.01, "dense_bytes": 1e6}
    big = {"dense_pull_floor_s": 8.9, "dense_bytes": 5.5e8}
    assert train.speed_timeout(small, 4, 5, 2, 4) < train.speed_timeout(big, 4, 5, 2, 4)
    assert 240 < train.speed_timeout(small, 4, 5, 2, 4) < 2000
    assert train.tta_timeout(small, 4, 150, 15) < train.tta_timeout(big, 4, 150, 15)


def test_speed_table_and_plot(tmp_path):
    rounds = [_round(2.0, 0.5, 1.7)]
    ok = train.summarise_speed([_worker(0, rounds), _worker(1, rounds)], None, None, 1)
    report = {"results": {"resnet50_v1b": train.add_speedups(
                  {"dist_sync": ok, "hylo": {"status": "failed: boom"}})},
              "config": {"image_sizes": {"resnet50_v1b": 64}, "batch_size": 8,
                         "workers": 2, "servers": 1, "rate": "1gbit"},
              "machine": {"cpu": "X"}, "date": "2026-11-23T10:00:00"}
    lines = train.format_speed_table(report)
    assert "1.00x" in lines[1] and "failed: boom" in lines[2]
    train.write_speed_plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- as root

needs_netns = pytest.mark.skipif(not netns.namespaces_usable(),
                                 reason="needs root and iproute2 to create network namespaces")


# default run: bench train's harness for real in test_bench_horovod.py (its Horovod
# peers); these stores trained over the servers in test_bench_fp16.py (dist_sync_fp16),
# test_dist.py and test_user_scripts.py (hylo on either route, dist_sync)
@pytest.mark.slow
@needs_netns
def test_tiny_real_run(tmp_path):
    out = tmp_path / "train.json"
    report = train.run(_args([
        "-n", "2", "-s", "1", "--models", "cifar_resnet20_v1", "--image-size", "16",
        "--classes", "10", "--modes", "dist_sync,dist_sync_fp16,hylo,hylo_workers",
        "--steps", "1",
        "--warmup", "1", "--stream-steps", "1", "--timeout", "120",
        # hylo on the servers' route (its warm-up of 30 steps never comes: the run must
        # not wait for it), hylo_workers with the update on the workers
        "--hylo-options", json.dumps({"server_update": True}), "--json", str(out)]))
    assert netns.own_namespaces("mxhcomm%d-" % os.getpid()) == []
    per_mode = report["results"]["cifar_resnet20_v1"]
    for mode in ("dist_sync", "dist_sync_fp16", "hylo", "hylo_workers"):
        r = per_mode[mode]
        assert r["status"] == "ok", r.get("log_tail", r["status"])
        assert r["step_s"] > 0 and r["fwd_bwd_s"] > 0 and r["exchange_s"] > 0
        assert r["workers_identical"], r["param_sha256"]
        assert r["wire"]["push_bytes_per_step"] > 0
    assert per_mode["dist_sync"]["update_on_kvstore"] is True      # Gluon's default
    assert per_mode["hylo"]["update_on_kvstore"] is True           # the servers' route
    assert per_mode["hylo"]["store_warmup_steps_run"] == 1        # (the first step)
    assert per_mode["hylo"]["wire"]["push_bytes_per_step"] >= \
        0.9 * per_mode["dist_sync"]["wire"]["push_bytes_per_step"]  # dense pushes
    assert per_mode["hylo_workers"]["update_on_kvstore"] is False
    hy = per_mode["hylo_workers"]["hylo"]
    # measured past hylo's dense warm-up, if the store has one: compressed pushes
    assert hy["bytes_pushed_per_step"] < hy["dense_bytes_per_step"]
    assert per_mode["dist_sync"]["store_warmup_steps_run"] == 0
    assert per_mode["dist_sync"]["speedup_vs_dist_sync"] == pytest.approx(1.0)
    # dist_sync_fp16: float16 gradients both ways, half of dist_sync's bytes (which
    # pushes float32 gradients and pulls float32 weights), the update on the workers
    half, dense = per_mode["dist_sync_fp16"], per_mode["dist_sync"]
    assert half["update_on_kvstore"] is False
    for way in ("push_bytes_per_step", "pull_bytes_per_step"):
        assert 0.4 < half["wire"][way] / dense["wire"][way] < 0.6, way
    assert report["mode_descriptions"]["dist_sync_fp16"]
    assert per_mode["hylo"]["best_peer"] in ("dist_sync", "dist_sync_fp16")
    assert (tmp_path / "train.png").exists()
    assert report["machine"]["cpu_features"] is not None


@needs_netns
def test_sigterm_mid_run_removes_everything(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxhylo.bench", "train", "-n", "2", "-s", "1",
         "--models", "cifar_resnet20_v1", "--image-size", "16", "--classes", "10",
         "--modes", "hylo", "--steps", "50", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = "mxhcomm%d-" % proc.pid
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                "train_worker" in _cmdline(pid) for pid in _descendants(proc.pid)):
            time.sleep(0.2)
        assert netns.own_namespaces(prefix), "the run never started its workers"
        children = [pid for pid in _descendants(proc.pid) if "mxnet" in _cmdline(pid)
                    or "mxhylo" in _cmdline(pid)]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert netns.own_namespaces(prefix) == [], out[-2000:]
    assert children
    left = [pid for pid in children if "mxnet" in _cmdline(pid) or "mxhylo" in _cmdline(pid)]
    assert left == []


def _all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _descendants(root):
    parents = {}
    for pid in _all_pids():
        try:
            with open("/proc/%d/stat" % pid) as f:
                data = f.read()
            parents[pid] = int(data[data.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):
            pass
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def test_nooverlap_mode_makes_its_store_with_the_switch_off(monkeypatch):
    """hylo_nooverlap: the worker turns mxhylo.kvstore.hylo.OVERLAP off before it makes
    its store (no option does it)."""
    from mxhylo.kvstore import hylo
    monkeypatch.setattr(hylo, "OVERLAP", True)
    kv, update_on_kvstore = train_worker.HyloNoOverlap().kvstore({})
    assert kv.overlap is False and kv.pipeline.order == "after"
    assert update_on_kvstore is None
    assert train_worker.HyloNoOverlap.options == {}
