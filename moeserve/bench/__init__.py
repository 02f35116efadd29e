"""Benchmarks: the HTTP client (`bench serve`) and the in-process engine benchmarks."""
