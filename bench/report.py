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


# ---- the weight_bridge backend behind vllm serve against the InferenceActor --------------------------

SERVE_GOAL = 1.2  # vllm serve's syncs against the InferenceActor's, same transport and mode
CONTROL_ROUTES = ("pause", "start_weight_update", "finish_weight_update", "reset_prefix_cache", "resume")


def serve_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """``publish`` (tensors -> verified acks, as the InferenceActor rows time it) and ``send_weights`` (the whole
    call) over ``actor``: the InferenceActor's syncs alternating with them; ``*_over_row``: over the InferenceActor
    row of that transport/mode measured earlier in the run."""
    row["publish_over_actor"] = row["publish"] / row["actor"]
    row["send_over_actor"] = row["send_weights"] / row["actor"]
    if row.get("actor_row"):
        row["publish_over_row"] = row["publish"] / row["actor_row"]
        row["send_over_row"] = row["send_weights"] / row["actor_row"]
    return row


def control_seconds(row: dict[str, Any]) -> float:
    """Median seconds of vLLM's HTTP control calls around the publish (pause, start, finish, prefix-cache reset,
    resume; not ``update_weights``, which spans the publish)."""
    return sum(row.get("phases", {}).get(f"http_{route}", 0.0) for route in CONTROL_ROUTES)


def serve_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':>6} {'transport':>9} {'mode':>9} {'MB':>7} {'actor s':>8} {'publish s':>9} {'send s':>7} "
            f"{'pub/actor':>9} {'send/actor':>10} {'row s':>6} {'send/row':>8} {'outside ms':>10} {'control ms':>10}")
    lines = ["vllm serve (weight_bridge backend) against the InferenceActor, syncs alternating", head, "-" * len(head)]
    for r in rows:
        row_s = f"{r['actor_row']:.3f}" if r.get("actor_row") else ""
        send_row = f"{r['send_over_row']:.2f}" if r.get("send_over_row") else ""
        lines.append(
            f"{r['model']:>6} {r['transport']:>9} {r['mode']:>9} {r['bytes'] / 1e6:>7.0f} {r['actor']:>8.3f} {r['publish']:>9.3f} "
            f"{r['send_weights']:>7.3f} {r['publish_over_actor']:>9.2f} {r['send_over_actor']:>10.2f} {row_s:>6} {send_row:>8} "
            f"{1000 * r.get('phases', {}).get('outside_publish', 0.0):>10.0f} {1000 * control_seconds(r):>10.0f}")
    return "\n".join(lines)


def serve_verdict(rows: list[dict[str, Any]], goal: float = SERVE_GOAL) -> list[str]:
    if not rows:
        return []
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        parts = []
        for r in mine:
            rounds = (f" (rounds {statistics.median(r['paired_publish']):.2f} / {statistics.median(r['paired_send_weights']):.2f})"
                      if r.get("paired_publish") and r.get("paired_send_weights") else "")
            parts.append(f"{r['transport']}/{r['mode']} {r['publish_over_actor']:.2f} / {r['send_over_actor']:.2f}{rounds}")
        out.append(f"{model}: vllm serve over InferenceActor, publish / send_weights (goal <= {goal:g}x): " + ", ".join(parts))
    n = len(rows)
    publish_ok = sum(r["publish_over_actor"] <= goal for r in rows)
    send_ok = sum(r["send_over_actor"] <= goal for r in rows)
    line = f"vllm serve within {goal:g}x of the InferenceActor: publish {publish_ok}/{n}, send_weights {send_ok}/{n}"
    over = []
    for r in rows:
        missed = [f"{what} {r[key]:.2f}" for what, key in (("publish", "publish_over_actor"), ("send_weights", "send_over_actor"))
                  if r[key] > goal]
        if missed:
            over.append(f"{r['model']} {r['transport']}/{r['mode']} {', '.join(missed)} (outside the publish "
                        f"{1000 * r.get('phases', {}).get('outside_publish', 0.0):.0f} ms, of which HTTP control calls "
                        f"{1000 * control_seconds(r):.0f} ms)")
    if over:
        line += "; over: " + "; ".join(over)
    out.append(line)
    return out


# ---- LoRA: an adapter's sync against a full sync and merge-then-sync ----------------------------------

def lora_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """Over the adapter sync (medians of the same rounds): ``full_over_adapter`` (a full sync of the same model),
    ``merged_over_adapter`` (merging the adapter into the base in the trainer, then a full sync) and the bytes
    each carried, ``full_bytes_over_adapter``."""
    row["full_over_adapter"] = row["full"] / row["adapter"]
    row["merged_over_adapter"] = row["merged"] / row["adapter"]
    row["full_bytes_over_adapter"] = row["full_bytes"] / row["adapter_bytes"]
    return row


def lora_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':>6} {'transport':>9} {'rank':>4} {'adapterMB':>9} {'fullMB':>7} {'adapter s':>9} {'full s':>7} "
            f"{'merged s':>8} {'merge s':>7} {'full/adapter':>12} {'merged/adapter':>14} {'bytes full/adapter':>18}")
    lines = ["LoRA: adapter-only sync against a full sync and merge-then-full-sync, same engine, rounds alternating",
             head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:>6} {r['transport']:>9} {r['rank']:>4} {r['adapter_bytes'] / 1e6:>9.2f} {r['full_bytes'] / 1e6:>7.0f} "
            f"{r['adapter']:>9.3f} {r['full']:>7.3f} {r['merged']:>8.3f} {r['merge']:>7.3f} {r['full_over_adapter']:>12.1f} "
            f"{r['merged_over_adapter']:>14.1f} {r['full_bytes_over_adapter']:>18.0f}")
    return "\n".join(lines)


def lora_verdict(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        rounds = ""
        if r.get("paired_full_over_adapter") and r.get("paired_merged_over_adapter"):
            rounds = (f" (per round: full/adapter median {statistics.median(r['paired_full_over_adapter']):.1f}, "
                      f"merged/adapter {statistics.median(r['paired_merged_over_adapter']):.1f})")
        out.append(f"{r['model']}: LoRA r={r['rank']} over {r['transport']}: adapter sync {r['adapter']:.3f}s for "
                   f"{r['adapter_bytes'] / 1e6:.2f} MB; a full sync takes {r['full_over_adapter']:.1f}x as long, "
                   f"merge-then-sync {r['merged_over_adapter']:.1f}x (the merge alone {r['merge']:.3f}s), "
                   f"carrying {r['full_bytes_over_adapter']:.0f}x the bytes{rounds}")
    return out
