"""Layer policy: the classification rule, the adaptive rate, overrides, and real models."""
import numpy as np
import pytest

from mxhylo.kvstore import LayerPolicy, adaptive_conv_rate


def test_rule_by_shape_and_size():
    p = LayerPolicy(size_threshold=1000)
    assert p.plan("small_conv", (4, 4, 3, 3)).strategy == "none"        # 144 < 1000
    assert p.plan("conv", (512, 64, 3, 3)).strategy == "conv_topk"
    assert p.plan("conv_2bit", (64, 16, 3, 3)).strategy == "fc_2bit"    # see below
    assert p.plan("fc", (100, 100)).strategy == "fc_2bit"
    assert p.plan("fc_small", (10, 99)).strategy == "none"               # 990 < 1000
    assert p.plan("bias", (5000,)).strategy == "none"                   # 1-D: never compressed
    assert p.plan("conv3d", (8, 8, 4, 4, 4)).strategy == "none"          # 5-D: not a 2-D conv
    assert p.plan("at_threshold", (10, 100)).strategy == "fc_2bit"       # 1000 is not below


def _topk_costs_at_least_2bit(shape, threshold=8192):
    """Independent of the codecs: bytes of k filters (int32 index + float32 values)
    against 2 bits per element in int32 words of 16 codes plus a float32 threshold."""
    n = int(np.prod(shape))
    rate = min(0.1, max(0.01, 0.1 * (threshold / n) ** 0.25))
    k = max(1, int(round(rate * shape[0])))
    return k * (4 + 4 * (n // shape[0])) >= 4 * -(-n // 16) + 4


@pytest.mark.parametrize("shape", [(64, 16, 3, 3), (64, 32, 3, 3), (64, 64, 3, 3),
                                   (256, 64, 1, 1), (64, 3, 11, 11), (128, 64, 3, 3),
                                   (96, 64, 3, 3), (128, 128, 3, 3), (512, 512, 3, 3),
                                   (1, 8192, 1, 1), (8192, 1, 1, 1)])
def test_conv_goes_2bit_where_topk_would_cost_as_many_bytes(shape):
    """A conv weight above the threshold goes top-k only where that sends fewer bytes
    than 2 bits per element; a fixed conv_rate keeps every conv on top-k."""
    plan = LayerPolicy().plan("conv", shape)
    assert plan.strategy == ("fc_2bit" if _topk_costs_at_least_2bit(shape) else "conv_topk")
    assert LayerPolicy(conv_rate=0.05).plan("conv", shape).strategy == "conv_topk"


def test_2bit_takes_the_small_convs_and_topk_the_large():
    p = LayerPolicy()
    assert p.plan("c", (64, 64, 3, 3)).strategy == "fc_2bit"         # 36864: k = 4 of 64
    assert p.plan("c", (512, 512, 3, 3)).strategy == "conv_topk"     # 2.4 M: k = 12 of 512
    # the boundary: about 54 K elements, where the adaptive rate reaches 1/16
    assert p.plan("c", (128, 64, 3, 3)).strategy == "conv_topk"      # 73728


def test_adaptive_rate_formula_and_k():
    t = 8192
    assert adaptive_conv_rate(t) == pytest.approx(0.1)
    assert adaptive_conv_rate(t // 2) == pytest.approx(0.1)             # clipped at max
    assert adaptive_conv_rate(256 * t) == pytest.approx(0.025)
    assert adaptive_conv_rate(10 ** 9) == pytest.approx(0.01)           # clipped at min
    sizes = [t, 4 * t, 50 * t, 300 * t]
    rates = [adaptive_conv_rate(n) for n in sizes]
    assert all(a > b for a, b in zip(rates, rates[1:]))                  # bigger -> smaller
    plan = LayerPolicy().plan("c", (512, 512, 3, 3))
    expect = 0.1 * (8192 / (512 * 512 * 9)) ** 0.25
    assert plan.rate == pytest.approx(expect)
    assert plan.k == max(1, int(round(expect * 512)))
    # the size threshold says which layers are compressed, not how hard
    for threshold in (1024, 8192, 100000):
        low = LayerPolicy(size_threshold=threshold).plan("c", (512, 512, 3, 3))
        assert (low.rate, low.k) == (plan.rate, plan.k)
    assert LayerPolicy(size_threshold=1024).plan("c", (64, 64, 3, 3)).strategy == "fc_2bit"
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
    # Independent expectations per model, from the architectures.
    if model == "resnet50_v1b":
        fc = [n for n in shapes if n.endswith("dense0_weight") or n.endswith("fc_weight")]
        assert [plans[n].strategy for n in fc] == ["fc_2bit"]           # (1000, 2048)
        # the stem (9408 elements) and layer1's 3x3 (36864) go 2-bit: top-k would not
        # send fewer bytes there
        assert plans[[n for n in shapes if shapes[n] == (64, 3, 7, 7)][0]].strategy == "fc_2bit"
        # layer1's 1x1 64->64 convs (4096 elements) travel as they are
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (64, 64, 1, 1))
        assert all(plans[n].strategy == "conv_topk" for n in shapes if shapes[n] == (512, 512, 3, 3))
        convs = [s for s in shapes.values() if len(s) == 4 and np.prod(s) >= 8192]
        assert len(by["conv_topk"]) == sum(not _topk_costs_at_least_2bit(s) for s in convs)
        assert len(by["fc_2bit"]) == 1 + sum(_topk_costs_at_least_2bit(s) for s in convs)
        assert len(by["conv_topk"]) > 20          # most conv layers still send filters
    elif model == "cifar_resnet20_v1":
        # dense (10, 64) is small: every 2-bit layer is a conv
        assert by["fc_2bit"] and all(len(p.shape) == 4 for p in by["fc_2bit"])
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (16, 16, 3, 3))
        # its largest convs (36864 elements) would send 4 of 64 filters: 2 bits instead
        assert all(plans[n].strategy == "fc_2bit" for n in shapes if shapes[n] == (64, 64, 3, 3))
        assert not by["conv_topk"]
    else:  # alexnet: 5 convs, all above threshold (the first, 23232, goes 2-bit); 3 dense
        assert len(by["conv_topk"]) == 4
        assert len(by["fc_2bit"]) == 4
    assert all(p.strategy == "none" for p in plans.values() if len(p.shape) == 1)
    # compressed layers hold most of the parameters
    total = sum(p.size for p in plans.values())
    compressed = sum(p.size for p in plans.values() if p.strategy != "none")
    assert compressed / total > 0.9
