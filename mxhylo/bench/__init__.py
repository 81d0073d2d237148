"""Benchmarks: ``python -m mxhylo.bench {comm,train,accuracy,scale,ops,io,lars}``."""
