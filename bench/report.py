"""The benchmark's report: ratios against the baselines measured in the same run, the linear fit of time
against size, the printed table and the verdict against the project's goals. Pure functions over rows."""

from __future__ import annotations

import statistics
from typing import Any


def add_ratios(row: dict[str, Any]) -> dict[str, Any]:
    row["bridge_over_baseline_b"] = row["bridge"] / row["baseline_b"]
    row["baseline_a_over_bridge"] = row["baseline_a"] / row["bridge"]
    row["bridge_over_limit"] = row["bridge"] / row["limit"]
    row["bridge_gbps"] = row["bytes"] / row["bridge"] / 1e9
    if row.get("transport_alone"):
        row["transport_gbps"] = row["bytes"] / row["transport_alone"] / 1e9
        row["transport_over_copy"] = row["transport_gbps"] / row["copy_gbps"]
    if row.get("transport_alone_raw"):
        row["transport_raw_gbps"] = row["bytes"] / row["transport_alone_raw"] / 1e9
        row["transport_raw_over_copy"] = row["transport_raw_gbps"] / row["copy_gbps"]
    return row


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``seconds = a + b * bytes``: (a, b, r2)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for _, y in points)
    ss_res = sum((y - a - b * x) ** 2 for x, y in points)
    return a, b, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':>6} {'transport':>9} {'mode':>9} {'bktMB':>5} {'recv':>4} {'MB':>7} {'bridge s':>9} {'A s':>7} {'B s':>7} "
            f"{'limit s':>8} {'bridge/B':>8} {'A/bridge':>8} {'br/limit':>8} {'GB/s':>6} {'aloneGB/s':>9} {'peakMB':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = r.get("peak_rss_growth_bytes")
        alone = f"{r['transport_gbps']:.2f}" if r.get("transport_gbps") else ""
        lines.append(
            f"{r['model']:>6} {r['transport']:>9} {r['mode']:>9} {r.get('bucket_mb', 0):>5g} {r['receivers']:>4} {r['bytes'] / 1e6:>7.0f} "
            f"{r['bridge']:>9.3f} {r['baseline_a']:>7.3f} {r['baseline_b']:>7.3f} {r['limit']:>8.3f} "
            f"{r['bridge_over_baseline_b']:>8.2f} {r['baseline_a_over_bridge']:>8.2f} {r['bridge_over_limit']:>8.1f} "
            f"{r['bridge_gbps']:>6.2f} {alone:>9} {'' if peak is None else f'{peak / 1e6:.0f}':>7}")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for model in sorted({r["model"] for r in rows}, key=lambda m: rows[[x["model"] for x in rows].index(m)]["bytes"]):
        single = [r for r in rows if r["model"] == model and r["receivers"] == 1 and not r.get("sweep")]
        best = min(single, key=lambda r: r["bridge"])
        paired = f" [each sync over the B run after it: median {statistics.median(best['paired_ratios']):.2f}]" if best.get("paired_ratios") else ""
        out.append(f"{model}: fastest {best['transport']}/{best['mode']}: bridge/B={best['bridge_over_baseline_b']:.2f} "
                   f"(goal <= 1.25){paired}, A/bridge={best['baseline_a_over_bridge']:.2f} (goal >= 3)")
        scale = sorted((r for r in rows if r["model"] == model and r["transport"] == best["transport"]
                        and r["mode"] == best["mode"] and not r.get("sweep") and not r.get("fanout")), key=lambda r: r["receivers"])
        sweep = sorted((r for r in rows if r["model"] == model and r["receivers"] == 1 and r["transport"] == best["transport"]
                        and r["mode"] == best["mode"]), key=lambda r: r.get("bucket_mb", 0))
        if len(sweep) > 1:
            out.append(f"{model}: {best['transport']}/{best['mode']} by bucket size: "
                       + ", ".join(f"{r.get('bucket_mb', 0):g} MB {r['bridge']:.3f}s" for r in sweep))
        staged = [r for r in single if r["mode"] == "staged" and r.get("peak_rss_growth_bytes") is not None]
        streaming = [r for r in single if r["mode"] == "streaming" and r.get("peak_rss_growth_bytes") is not None]
        if staged and streaming:
            out.append(f"{model}: peak inference-side RSS growth during a sync: staged "
                       f"{max(r['peak_rss_growth_bytes'] for r in staged) / 1e6:.0f} MB, streaming "
                       f"{max(r['peak_rss_growth_bytes'] for r in streaming) / 1e6:.0f} MB (update {best['bytes'] / 1e6:.0f} MB; "
                       f"not counted: the bucket segments in shared memory, mapped since the previous update)")
        shm = {r["mode"]: r for r in single if r["transport"] == "shm" and r.get("publisher_held_bytes") is not None}
        if len(shm) == 2:
            out.append(f"{model}: shm bucket segments the publisher keeps in /dev/shm: staged "
                       f"{shm['staged']['publisher_held_bytes'] / 1e6:.0f} MB (the whole update), streaming "
                       f"{shm['streaming']['publisher_held_bytes'] / 1e6:.0f} MB (a ring of {shm['streaming'].get('bucket_mb', 0):g} MB "
                       f"buckets, each rewritten once the engines released it)")
        if len(scale) > 1:
            out.append(f"{model}: receivers " + ", ".join(f"{r['receivers']}: {r['bridge'] / scale[0]['bridge']:.2f}x" for r in scale)
                       + " (goal: 4 receivers <= 1.5x)")
            if all(r.get("baseline_b_concurrent") for r in scale):
                out.append(f"{model}: baseline B on every engine at once (the floor for their reloads on this machine) "
                           + ", ".join(f"{r['receivers']}: {r['baseline_b_concurrent'] / scale[0]['baseline_b_concurrent']:.2f}x"
                                       for r in scale)
                           + "; bridge over that floor " + ", ".join(f"{r['receivers']}: {r['bridge'] / r['baseline_b_concurrent']:.2f}"
                                                                    for r in scale))
            if all(r.get("transport_alone") for r in scale):
                out.append(f"{model}: {best['transport']} alone (receivers without engines) " + ", ".join(
                    f"{r['receivers']}: {r['transport_alone'] / scale[0]['transport_alone']:.2f}x" for r in scale))
        fanout = {(r["transport"], r["receivers"]): r for r in rows if r["model"] == model and r.get("fanout")}
        for count in sorted({n for _, n in fanout}):
            direct, relay = fanout.get(("zmq", count)), fanout.get(("relay", count))
            if direct and relay:
                out.append(f"{model}: {count} engines over tcp://: one stream each {direct['bridge']:.3f}s, one stream to a "
                           f"host-local relay {relay['bridge']:.3f}s (direct/relay {direct['bridge'] / relay['bridge']:.2f})")
    for transport in sorted({r["transport"] for r in rows if r.get("transport_over_copy")}):
        alone = list({r["model"]: r for r in rows if r["transport"] == transport and r.get("transport_over_copy")
                      and r["receivers"] == 1 and not r.get("sweep")}.values())
        out.append(f"{transport} alone (no engine): " + ", ".join(
            f"{r['model']} {r['transport_gbps']:.2f} GB/s = {100 * r['transport_over_copy']:.0f}% of copy bandwidth"
            + (f" (raw, no checksums: {r['transport_raw_gbps']:.2f} GB/s = {100 * r['transport_raw_over_copy']:.0f}%)"
               if r.get("transport_raw_gbps") else "") for r in alone)
            + (" (goal for shm: >= 60%)" if transport == "shm" else ""))
    singles = [r for r in rows if r["receivers"] == 1 and not r.get("sweep")]
    for key in sorted({(r["transport"], r["mode"]) for r in singles}):
        pts = sorted((r["bytes"], r["bridge"]) for r in singles if (r["transport"], r["mode"]) == key)
        if len(pts) >= 3:
            a, b, r2 = linear_fit(pts)
            out.append(f"{key[0]}/{key[1]} vs model size: seconds = {a:.3f} + {b * 1e9:.3f} per GB (r2 {r2:.3f})")
    return out
