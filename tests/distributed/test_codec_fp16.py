"""The fp16 codec (kvstore/codec_fp16.py): a codec added as one file plus one registry
entry. Checked against numpy in one process, and end to end over the parameter
server (2 workers + 2 servers, the layer cut into chunks), with nothing else in the
store, transports or servers naming it."""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import mxhylo
from mxhylo.kvstore.codec_fp16 import FP16_MAX, Float16
from mxhylo.kvstore.memory import ResidualMemory
from mxhylo.kvstore.policy import LayerPlan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def reference(grads):
    """numpy: per step sent = fp16(clip(g + r)), r <- (g + r) - sent (float32)."""
    r = np.zeros_like(grads[0], np.float32)
    sent = []
    for g in grads:
        t = g.astype(np.float32) + r
        h = np.clip(t, -FP16_MAX, FP16_MAX).astype(np.float16)
        r = t - h.astype(np.float32)
        sent.append(h)
    return sent, r


@pytest.mark.parametrize("shape,dtype", [((1,), np.float32), ((17,), np.float32),
                                         ((3, 5, 7), np.float32), ((64, 33), np.float16),
                                         ((1000,), np.float32)])
def test_fp16_matches_numpy_with_error_feedback(shape, dtype):
    rng = np.random.RandomState(sum(shape))
    grads = [rng.normal(0, 1e-3, shape).astype(dtype) for _ in range(4)]
    grads[1].reshape(-1)[0] = 1e6 if dtype == np.float32 else 6e4   # beyond fp16 / near
    grads[2][...] = 0                                                 # an all-zero step
    grads[3].reshape(-1)[-1] = 1e-9                                   # below fp16's range
    codec, memory = Float16(), ResidualMemory()
    plan = LayerPlan("w", shape, "fp16")
    want, residual = reference(grads)
    for g, h in zip(grads, want):
        payload = codec.encode(plan, mx.nd.array(g, dtype=dtype), memory)
        np.testing.assert_array_equal(payload.arrays[0].asnumpy().view(np.uint16),
                                      h.view(np.uint16))
        out = mx.nd.ones(shape) * 2
        codec.decode(payload, out, accumulate=True)
        np.testing.assert_array_equal(out.asnumpy(), 2 + h.astype(np.float32))
    np.testing.assert_array_equal(memory.get("w").asnumpy(), residual)
    assert np.isfinite(memory.get("w").asnumpy()).all()


def test_fp16_non_finite_gradient_raises_and_leaves_the_residual():
    codec, memory = Float16(), ResidualMemory()
    plan = LayerPlan("fc", (4, 4), "fp16")
    codec.encode(plan, mx.nd.array(np.full((4, 4), 1e-4 + 1e-8, np.float32)), memory)
    before = memory.get("fc").asnumpy().copy()
    for bad in (np.nan, np.inf, -np.inf):
        g = np.zeros((4, 4), np.float32)
        g[1, 2] = bad
        with pytest.raises(FloatingPointError, match="'fc': 1 of 16"):
            codec.encode(plan, mx.nd.array(g), memory)
        np.testing.assert_array_equal(memory.get("fc").asnumpy(), before)


def test_policy_names_the_codec_from_the_registry():
    kv = mxhylo.create(policy={"emb": "fp16"})
    assert kv.policy.plan("emb_weight", (10, 4)).strategy == "fp16"
    with pytest.raises(ValueError, match="fp16"):            # the error lists it too
        mxhylo.create(policy={"x": "fp8"})


def test_fp16_end_to_end_over_the_parameter_server(tmp_path):
    """Two workers push fp16 payloads of a layer cut into 3 chunks, with error feedback;
    both pull (the default 'gather' pull) exactly the sum of the two workers' fp16
    values computed here in numpy, for 3 steps. On the wire 2 bytes per element travel
    30 bits per float32 value (kvstore.wire: raw bits could be altered by the servers'
    sum), so a push is about 0.53 of dense, not half."""
    out = str(tmp_path / "fp16-{rank}.json")
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout", "120",
           sys.executable, os.path.join(ROOT, "tests", "distributed", "jobs", "dist_keys_worker.py"), "fp16", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shape, steps = (96, 1000), 3
    sent = []
    for rank in range(2):
        rng = np.random.RandomState(300 + rank)
        sent.append(reference([rng.normal(0, 1, shape).astype(np.float32) * 1e-2
                               for _ in range(steps)])[0])
    for rank in range(2):
        got = np.load(out.format(rank=rank) + ".npz")
        for step in range(steps):
            want = (np.float32(0) + sent[0][step].astype(np.float32)) \
                + sent[1][step].astype(np.float32)
            np.testing.assert_array_equal(got["fc/%d" % step], want, err_msg=str(step))
        report = json.load(open(out.format(rank=rank)))
        assert report["policy"] == "fp16" and report["chunks"] == 3
        # 2 * 16/15 bytes per element plus row padding and ids, against 4 bytes dense
        assert report["bytes_pushed"] < 0.56 * report["dense_bytes"], report
