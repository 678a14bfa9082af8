"""Trainer side: the publisher that streams weight versions to inference engines."""

from trainer_side.publisher import EngineReport, PublishReport, WeightPublisher

__all__ = ["EngineReport", "PublishReport", "WeightPublisher"]
