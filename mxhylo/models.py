"""Small reference networks used by the demo, the tests and the accuracy studies."""
from mxnet import gluon


def digits_net(width=64, hidden=512, classes=10):
    """A conv+dense net for 8x8 digits whose layers exercise every Hylo policy.

    Layers (parameter counts for the defaults): conv1 16x1x3x3 (144, travels
    uncompressed), conv2 ``width``x16x3x3 (9216, fc_2bit; conv_topk with a conv_rate), dense1
    ``hidden``x(width*16) (524288, fc_2bit), dense2 10x``hidden`` (5120, uncompressed),
    plus biases and BatchNorm parameters (uncompressed).
    """
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(width, 3, padding=1),
            gluon.nn.BatchNorm(),
            gluon.nn.Activation("relu"),
            gluon.nn.MaxPool2D(2),                      # 8x8 -> 4x4
            gluon.nn.Dense(hidden, activation="relu"),
            gluon.nn.Dense(classes))
    return net


def conv_net(classes=10):
    """A conv-heavy net for digits upscaled to 16x16, where conv layers carry most bytes.

    Layers (parameter counts): conv 32x1x3x3 (288, uncompressed), conv 64x32x3x3
    (18432, fc_2bit), pool, conv 64x64x3x3 (36864, fc_2bit), pool, dense 256x1024
    (262144, fc_2bit), dense 10x256 (2560, uncompressed), biases. No BatchNorm: at
    learning rates 0.05-0.1 with momentum 0.9 dense training is itself near the edge of
    stability, which is where a compressed exchange's delays show first.
    """
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),                      # 16x16 -> 8x8
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),                      # 8x8 -> 4x4
            gluon.nn.Dense(256, activation="relu"),
            gluon.nn.Dense(classes))
    return net


def resnet20(classes=10):
    """gluoncv's cifar_resnet20_v1 (residual, BatchNorm; 19 conv layers, 0.27 M
    parameters, the largest 36864: fc_2bit above the size threshold)."""
    from gluoncv.model_zoo import get_model
    return get_model("cifar_resnet20_v1", classes=classes)


# name -> (constructor, input size in pixels, input channels): the digits studies' nets
NETS = {"digits_net": (digits_net, 8, 1), "conv_net": (conv_net, 16, 1),
        "resnet20": (resnet20, 16, 3)}
