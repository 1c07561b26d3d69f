"""Benchmark pages: tables and plots generated from ``benchmarks/results/*.json``."""


def setup(app):
    return {"parallel_read_safe": True, "parallel_write_safe": True}
