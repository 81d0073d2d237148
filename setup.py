"""mxhylo: layer-aware gradient compression for MXNet's parameter server.

The repository keeps the design card's top-level layout (mxhylo/, kvstore/, ops/);
package_dir maps kvstore/ and ops/ to the importable names mxhylo.kvstore and
mxhylo.ops, so one `pip install -e .` makes the whole tree importable.
"""
import sys

from setuptools import setup

if sys.version_info[:2] != (3, 11):
    sys.exit("mxhylo needs Python 3.11: mxnet 1.9.1 needs numpy<1.24, which has no "
             "wheels for Python %d.%d." % sys.version_info[:2])

setup(
    name="mxhylo",
    version="0.1.0",
    description="Hylo layer-aware gradient compression, LARS and pipelined input for MXNet",
    python_requires="==3.11.*",
    packages=["mxhylo", "mxhylo.bench", "mxhylo.io", "mxhylo.kvstore", "mxhylo.ops"],
    package_dir={"mxhylo.kvstore": "kvstore", "mxhylo.ops": "ops"},
    package_data={"mxhylo.ops": ["src/*.cc", "src/*.h"]},
    install_requires=["mxnet==1.9.1", "numpy==1.23.5"],
)
