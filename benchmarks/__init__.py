"""Benchmarks of hypergrad: ``python -m benchmarks [suite ...] [--quick]`` (see ``__main__``)."""
