"""A busy loop that keeps one core loaded: ``python busy.py SECONDS`` spins until
SECONDS have passed (a bound, should the test that started it not end it)."""
import sys
import time

deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    pass
