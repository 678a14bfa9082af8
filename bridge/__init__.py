"""weight-bridge: shared parts of the trainer and inference sides (wire format, transports, config)."""

PROTOCOL_VERSION = 2  # 2: Manifest.delta (bridge/delta.py)
