# Set-up is part of every target: a fresh machine needs only Python 3.11, make and g++.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.py
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v == (3, 11) else \
	  "mxhylo needs Python 3.11 (mxnet 1.9.1 needs numpy<1.24, which has no wheels for %d.%d); set PYTHON=python3.11" % v)'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	# Horovod (the ring-allreduce transport, kvstore/transport_horovod.py) builds from
	# source against the mxnet installed above: its cmake imports mxnet to find the
	# headers, which pip's isolated build environment lacks ("Could NOT find Mxnet"),
	# hence --no-build-isolation, which in turn needs wheel in the venv. CPU only:
	# MXNet and Gloo, no MPI/TensorFlow/PyTorch. 2-6 minutes (cmake and g++).
	$(VENV)/bin/pip install -q wheel==0.44.0
	HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
	  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo \
	  $(VENV)/bin/pip install -q --no-build-isolation horovod==0.28.1
	# mxhylo's C++ operators for this CPU (ops/build.py, about 25 s), so that the first
	# job does not compile them while its other processes wait; without a compiler
	# mxhylo runs on its NDArray reference
	$(VENV)/bin/python -c "from mxhylo.ops import build; print(build.build())" || \
	  echo "mxhylo: the C++ operators did not compile (above); the NDArray reference runs instead"
	touch $@

demo: setup  ## the main job: 2 workers + 1 server on the digits, over MXNet's parameter server
	$(PY) -m mxhylo.launch -n 2 -s 1 --timeout 600 $(PY) examples/train_digits.py

test: setup  ## the default test run (heavier runs: $(PY) -m pytest --runslow)
	$(PY) -m pytest -q
