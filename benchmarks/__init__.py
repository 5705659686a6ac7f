"""Benchmarks: one module per question, each run as ``python -m benchmarks.<name>`` and printing one JSON object.

codec   what does the gradient codec cost and lose on one real gradient of a named model?
"""
