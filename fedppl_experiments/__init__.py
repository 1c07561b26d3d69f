"""Experiment runners behind the command line and the benchmarks (one module per paper)."""
