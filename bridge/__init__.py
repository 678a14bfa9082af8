"""weight-bridge: shared parts of the trainer and inference sides (wire format, transports, config)."""

PROTOCOL_VERSION = 3  # 2: Manifest.delta (bridge/delta.py); 3: BucketHeader.delta, the manifest names the base checksums
