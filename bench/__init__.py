"""Benchmarks run by `make bench` (`python -m bench`); results go to bench/results/."""
