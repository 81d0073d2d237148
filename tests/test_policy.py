"""Layer policy: the classification rule, the adaptive rate, overrides, and real models."""
import numpy as np
import pytest

from mxhylo.kvstore import LayerPolicy, adaptive_conv_rate


def test_rule_by_shape_and_size():
    p = LayerPolicy(size_threshold=1000)
    assert p.plan("small_conv", (4, 4, 3, 3)).strategy == "none"        # 144 < 1000
    assert p.plan("conv", (64, 16, 3, 3)).strategy == "conv_topk"
    assert p.plan("fc", (100, 100)).strategy == "fc_2bit"
    assert p.plan("fc_small", (10, 99)).strategy == "none"               # 990 < 1000
    assert p.plan("bias", (5000,)).strategy == "none"                   # 1-D: never compressed
    assert p.plan("conv3d", (8, 8, 4, 4, 4)).strategy == "none"          # 5-D: not a 2-D conv
    assert p.plan("at_threshold", (10, 100)).strategy == "fc_2bit"       # 1000 is not below


def test_adaptive_rate_formula_and_k():
    t = 8192
    assert adaptive_conv_rate(t, t) == pytest.approx(0.1)
    assert adaptive_conv_rate(256 * t, t) == pytest.approx(0.025)
    assert adaptive_conv_rate(10 ** 9, t) == pytest.approx(0.01)         # clipped at min
    sizes = [t, 4 * t, 50 * t, 300 * t]
    rates = [adaptive_conv_rate(n, t) for n in sizes]
    assert all(a > b for a, b in zip(rates, rates[1:]))                  # bigger -> smaller
    plan = LayerPolicy().plan("c", (512, 512, 3, 3))
    expect = 0.1 * (8192 / (512 * 512 * 9)) ** 0.25
    assert plan.rate == pytest.approx(expect)
    assert plan.k == max(1, int(round(expect * 512)))
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
        assert len(by["fc_2bit"]) == 1
        assert plans[[n for n in shapes if shapes[n] == (64, 3, 7, 7)][0]].strategy == "conv_topk"
        # layer1's 1x1 64->64 convs (4096 elements) travel as they are
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (64, 64, 1, 1))
        assert all(plans[n].strategy == "conv_topk" for n in shapes if shapes[n] == (512, 512, 3, 3))
        assert len(by["conv_topk"]) == sum(1 for s in shapes.values()
                                           if len(s) == 4 and np.prod(s) >= 8192)
    elif model == "cifar_resnet20_v1":
        assert not by["fc_2bit"]                                          # dense (10, 64) is small
        assert all(plans[n].strategy == "none" for n in shapes if shapes[n] == (16, 16, 3, 3))
        assert all(plans[n].strategy == "conv_topk" for n in shapes if shapes[n] == (64, 64, 3, 3))
    else:  # alexnet: 5 convs, all above threshold; 3 dense layers, all above
        assert len(by["conv_topk"]) == 5
        assert len(by["fc_2bit"]) == 3
    assert all(p.strategy == "none" for p in plans.values() if len(p.shape) == 1)
    # compressed layers hold most of the parameters
    total = sum(p.size for p in plans.values())
    compressed = sum(p.size for p in plans.values() if p.strategy != "none")
    assert compressed / total > 0.9
