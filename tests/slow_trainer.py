"""A trainer process whose packing is slowed down and reported, so a test can SIGKILL it mid-stream:
``python tests/slow_trainer.py ENDPOINT KIND SEED VERSION DELAY_S CONFIG_JSON`` prints ``PACKED i``
after packing bucket ``i`` (then sleeps ``DELAY_S``), and ``DONE ok`` at the end."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(endpoint: str, kind: str, seed: int, version: int, delay_s: float, config_json: str) -> None:
    import trainer_side.publisher as publisher
    from bridge.config import config_from_dict
    from devtools.tiny_models import build_model

    real_pack = publisher.pack_bucket

    def slow_pack(plan: Any, tensors: list[Any], index: int, *args: Any, **kwargs: Any) -> list[int]:
        sums = real_pack(plan, tensors, index, *args, **kwargs)
        print(f"PACKED {index}", flush=True)
        time.sleep(delay_s)
        return sums

    publisher.pack_bucket = slow_pack  # type: ignore[assignment]
    model = build_model(kind, seed)
    with publisher.WeightPublisher([endpoint], config=config_from_dict(json.loads(config_json))) as pub:
        report = pub.publish(model.named_parameters(), version=version)
    print(f"DONE {report.ok}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
