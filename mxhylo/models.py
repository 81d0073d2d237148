"""Small reference networks used by the demo, the tests and the accuracy studies."""
from mxnet import gluon


def digits_net(width=64, hidden=512, classes=10):
    """A conv+dense net for 8x8 digits whose layers exercise every Hylo policy.

    Layers (parameter counts for the defaults): conv1 16x1x3x3 (144, travels
    uncompressed), conv2 ``width``x16x3x3 (9216, conv_topk), dense1
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
