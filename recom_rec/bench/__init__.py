"""Benchmarks: ``python -m recom_rec.bench --help``."""
