"""Development tools: the cold-load oracle (``devtools.coldload``) and tiny random checkpoints
(``devtools.tiny_models``), used by the tests, the demo and the benchmark.

Layering (tests/test_imports.py checks it): ``devtools`` imports only ``bridge`` and itself.
"""
