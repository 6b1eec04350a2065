"""Benchmarks behind `kvmesh bench`: each returns a JSON-ready dict."""
