"""WeightPublisher: stream named tensors to every engine, return once each has applied (or refused).

One update: hello (engine dtype) -> manifest -> buckets in layer order, each packed while the previous
one is on the wire, never more in flight per engine than that engine granted -> end -> ack. The sending
half of the protocol (connecting, credits, acks, reports) is ``bridge.sender.UpdateSender``; this class
adds the packing of the trainer's tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from bridge import wire
from bridge.errors import ConfigError
from bridge.sender import EngineReport, PublishReport
from bridge.transports.base import OutgoingBucket
from trainer_side.delta_publish import DeltaSender
from trainer_side.packing import iter_named, make_plan, pack_bucket, plan_specs

__all__ = ["EngineReport", "PublishReport", "WeightPublisher"]


class WeightPublisher(DeltaSender):
    """Publishes weight versions to one or more inference endpoints (``tcp://host:port``).

    With ``sync.delta`` (``auto``, the default: over every transport but shm) it keeps the last version every engine applied (one model of host RAM
    in the wire dtype, also while publishing, plus the buckets in flight; ``base_bytes``) and sends each tensor as a patch against it when
    that pays; an engine that does not serve that base gets the version dense (trainer_side/delta_publish.py)."""

    # ---- publish ------------------------------------------------------------------------------
    def publish(self, weights: Iterable[tuple[str, Any]] | Any, version: int,
                probe: wire.ProbeSpec | None = None, adapter: wire.AdapterSpec | None = None) -> PublishReport:
        """Send one version to every engine; return after each applied it, raise UpdateFailed otherwise.

        With ``adapter``, ``weights`` are that LoRA adapter's tensors alone, named as PEFT saves them
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ...), and ``version`` is the
        adapter's own (each adapter counts its versions apart from the base's): engines started with LoRA
        enabled serve it under ``adapter.name`` once verified; the base weights are not touched."""
        if adapter is not None and probe is not None:
            raise ConfigError("a probe scores the base weights: publish an adapter without one")
        t_start = time.perf_counter()
        self._starting(version)
        dtype = self._agreed_dtype()
        named = list(iter_named(weights))
        plan, tensors = make_plan(named, dtype, self.config.transport.bucket_bytes)
        deltas = self.config.sync.deltas_over(self.transport) and adapter is None
        manifest = wire.Manifest(version=version, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes,
                                 publisher=self.name, transport=self.transport, probe=probe, checksum=self._checksum(),
                                 adapter=adapter, keep_base=deltas)
        if deltas:
            return self._publish_delta(manifest, plan, tensors, t_start)
        plane = self._plane()

        def pack(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
            buffer = plane.allocate(index, size)
            sums = pack_bucket(plan, tensors, index, buffer, checksum=manifest.checksum)
            return plane.seal(index, buffer), tuple(sums)

        return self._stream(manifest, plane, pack, t_start)
