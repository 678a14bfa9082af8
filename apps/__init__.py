"""Applications built on weight-bridge: the ``weight-bridge`` CLI, the demo, the trainer job, the Ray job,
the GRPO toy loop, the metrics hub and the dashboard service.

Layering (tests/test_imports.py checks it): ``apps`` may import ``bridge``, ``trainer_side``,
``inference_side``, ``devtools`` and itself; nothing below it imports ``apps``.
"""
