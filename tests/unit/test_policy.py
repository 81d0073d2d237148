"""Layer policy: the classification rule, the adaptive rate, overrides, and real models."""
import numpy as np
import pytest

from mxhylo.kvstore import LayerPolicy, adaptive_conv_rate


def test_rule_by_shape_and_size():
    p = LayerPolicy(size_threshold=1000)
    assert p.plan("small_conv", (4, 4, 3, 3)).strategy == "none"        # 144 < 1000
    assert p.plan("conv", (512, 64, 3, 3)).strategy == "fc_2bit"        # conv: 2-bit
    assert p.plan("conv_small", (64, 16, 3, 3)).strategy == "fc_2bit"
    assert p.plan("fc", (100, 100)).strategy == "fc_2bit"
    assert p.plan("fc_small", (10, 99)).strategy == "none"               # 990 < 1000
    assert p.plan("bias", (5000,)).strategy == "none"                   # 1-D: never compressed
    assert p.plan("conv3d", (8, 8, 4, 4, 4)).strategy == "none"          # 5-D: not a 2-D conv
    assert p.plan("at_threshold", (10, 100)).strategy == "fc_2bit"       # 1000 is not below


@pytest.mark.parametrize("shape", [(64, 16, 3, 3), (64, 3, 11, 11), (512, 512, 3, 3),
                                   (1, 8192, 1, 1), (8192, 1, 1, 1)])
def test_conv_goes_2bit_and_topk_only_at_a_given_rate(shape):
    """Every conv weight above the threshold goes 2-bit, whatever its size; a conv_rate
    turns every one of them to top-k filters at that rate."""
    assert LayerPolicy().plan("conv", shape).strategy == "fc_2bit"
    topk = LayerPolicy(conv_rate=0.05).plan("conv", shape)
    assert (topk.strategy, topk.rate) == ("conv_topk", 0.05)
    assert topk.k == max(1, int(round(0.05 * shape[0])))


def test_adaptive_rate_formula_and_k():
    t = 8192
    assert adaptive_conv_rate(t) == pytest.approx(0.1)
    assert adaptive_conv_rate(t // 2) == pytest.approx(0.1)             # clipped at max
    assert adaptive_conv_rate(256 * t) == pytest.approx(0.025)
    assert adaptive_conv_rate(10 ** 9) == pytest.approx(0.01)           # clipped at min
    sizes = [t, 4 * t, 50 * t, 300 * t]
    rates = [adaptive_conv_rate(n) for n in sizes]
    assert all(a > b for a, b in zip(rates, rates[1:]))                  # bigger -> smaller
    named = {"c": "conv_topk"}      # top-k named in the policy: the adaptive rate
    plan = LayerPolicy(policy=named).plan("c", (512, 512, 3, 3))
    expect = 0.1 * (8192 / (512 * 512 * 9)) ** 0.25
    assert plan.rate == pytest.approx(expect)
    assert plan.k == max(1, int(round(expect * 512)))
    # the size threshold says which layers are compressed, not how hard
    for threshold in (1024, 8192, 100000):
        low = LayerPolicy(size_threshold=threshold, policy=named).plan("c", (512, 512, 3, 3))
        assert (low.rate, low.k) == (plan.rate, plan.k)
    assert LayerPolicy(conv_rate=0.5).plan("c", (64, 16, 3, 3)).k == 32
    assert LayerPolicy(conv_rate=0.001).plan("c", (64, 16, 3, 3)).k == 1  # at least one filter


def test_overrides_in_order_and_errors():
    p = LayerPolicy(policy={"dense": "none", ".*conv.*": "fc_2bit"})
    assert p.plan("dense0_weight", (100, 100)).strategy == "none"
    assert p.plan("conv0_weight", (64, 16, 3, 3)).strategy == "fc_2bit"
    assert p.plan("other", (100, 100)).strategy == "fc_2bit"             # rule applies
    off = LayerPolicy(policy={".*": "none"})
    assert off.plan("conv", (512, 512, 3, 3)).strategy == "none"
    with pytest.raises(ValueError, match="strategy must be one of"):
        LayerPolicy(policy={".*": "topk"})
    with pytest.raises(ValueError, match="regular expression"):
        LayerPolicy(policy={"(": "none"})
    with pytest.raises(ValueError, match="conv_topk"):
        LayerPolicy(policy={"bias": "conv_topk"}).plan("bias", (64,))
    with pytest.raises(ValueError, match="conv_rate"):
        LayerPolicy(conv_rate=1.5)
    with pytest.raises(ValueError, match="size_threshold"):
        LayerPolicy(size_threshold=-1)


def _model_shapes(name, size):
    import mxnet as mx
    from gluoncv.model_zoo import get_model
    net = get_model(name, pretrained=False)
    net.initialize()
    net(mx.nd.zeros((1, 3, size, size)))
    return {n: p.shape for n, p in net.collect_params().items()}


@pytest.mark.parametrize("model,size", [("resnet50_v1b", 224), ("cifar_resnet20_v1", 32),
                                        ("alexnet", 224)])
def test_gluoncv_models(model, size):
    shapes = _model_shapes(model, size)
    policy = LayerPolicy()
    plans = {n: policy.plan(n, s) for n, s in shapes.items()}
    by = {s: [p for p in plans.values() if p.strategy == s] for s in ("none", "conv_topk", "fc_2bit")}
    # Independent expectations per model, from the architectures: every 2-D and 4-D
    # weight of 8192 elements or more goes 2-bit, nothing goes top-k unless asked
    big = {n for n, s in shapes.items() if len(s) in (2, 4) and np.prod(s) >= 8192}
    assert {p.name for p in by["fc_2bit"]} == big and not by["conv_topk"]
    if model == "resnet50_v1b":
        # layer1's 1x1 64->64 convs (4096 elements) travel as they are
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (64, 64, 1, 1))
        assert len(big) == 1 + 52      # the fc and 52 of the 53 convs (all but the 64x64x1x1)
    elif model == "cifar_resnet20_v1":
        # dense (10, 64) is small: every 2-bit layer is a conv
        assert big and all(len(shapes[n]) == 4 for n in big)
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (16, 16, 3, 3))
    else:  # alexnet: 5 convs, all above threshold; 3 dense
        assert len(big) == 8
    named = LayerPolicy(conv_rate=0.02)
    assert all(named.plan(n, shapes[n]).strategy == "conv_topk"
               for n in big if len(shapes[n]) == 4)
    assert all(p.strategy == "none" for p in plans.values() if len(p.shape) == 1)
    # compressed layers hold most of the parameters
    total = sum(p.size for p in plans.values())
    compressed = sum(p.size for p in plans.values() if p.strategy != "none")
    assert compressed / total > 0.9
