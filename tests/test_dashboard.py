"""Dashboard service: JSON API, /metrics, read-only routes, the poller, and the page rendered by real Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.dashboard import DashboardService, NamedActorSource, Poller
from apps.metrics import MetricsHub
from tests.dashboard_fixtures import STALE_TENSOR, ok_record, sample_hub, sample_records, status
from tests.helpers import ARTIFACTS

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-quic"]
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason="/usr/bin/chromium is absent: run scripts/setup_system.sh (apt chromium)")


@pytest.fixture(scope="module")
def service() -> Iterator[DashboardService]:
    svc = DashboardService(sample_hub(), port=0).start()
    yield svc
    svc.stop()


def request(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get_json(url: str) -> Any:
    code, _, body = request(url)
    assert code == 200, body
    return json.loads(body)


# ---- JSON API and metrics ------------------------------------------------------------------------
def test_service_binds_loopback_by_default(service: DashboardService) -> None:
    assert DashboardService(MetricsHub()).host == "127.0.0.1"
    assert service.url.startswith("http://127.0.0.1:") and service.port > 0


def test_records_api_lists_newest_last_and_honours_limit(service: DashboardService) -> None:
    records = get_json(f"{service.url}/api/records")
    expected = sample_records()
    assert [(r["engine"], r["version"], r["ok"]) for r in records] == [(r.engine, r.version, r.ok) for r in expected]
    assert records[-1]["stale_tensors"] == [STALE_TENSOR]
    last_two = get_json(f"{service.url}/api/records?limit=2")
    assert last_two == records[-2:]
    assert [r["engine"] for r in get_json(f"{service.url}/api/records?engine=engine-a")] == ["engine-a"] * 3
    assert request(f"{service.url}/api/records?limit=0")[0] == 422


def test_engines_api_reports_version_lag_health_and_alerts(service: DashboardService) -> None:
    view = get_json(f"{service.url}/api/engines")
    assert view["trainer_version"] == 3
    rows = {e["engine"]: (e["version"], e["lag"], e["health"]) for e in view["engines"]}
    assert rows == {"engine-a": (3, 0, "ok"), "engine-b": (2, 1, "degraded")}
    assert {e["engine"]: e["sequences_generated"] for e in view["engines"]} == {"engine-a": 96, "engine-b": None}
    assert any(a["kind"] == "stale" and STALE_TENSOR in a["message"] for a in view["alerts"])


def test_healthz_is_live_and_lists_unhealthy_engines(service: DashboardService) -> None:
    assert get_json(f"{service.url}/healthz") == {"ok": True, "engines": 2, "degraded": ["engine-b"]}


def test_metrics_endpoint_serves_prometheus_text(service: DashboardService) -> None:
    code, headers, body = request(f"{service.url}/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    lag = {s.labels["engine"]: s.value for s in fams["weight_bridge_engine_version_lag"].samples}
    assert lag == {"engine-a": 0, "engine-b": 1}


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/", "/metrics", "/api/records", "/api/engines", "/healthz"])
def test_write_methods_are_rejected(service: DashboardService, method: str, path: str) -> None:
    code, headers, _ = request(f"{service.url}{path}", method=method)
    assert code == 405 and headers.get("allow") == "GET"


def test_page_is_self_contained(service: DashboardService) -> None:
    code, headers, body = request(f"{service.url}/")
    html = body.decode()
    assert code == 200 and headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert "default-src 'none'" in headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page must load nothing from elsewhere"
    assert "<script src" not in html and "api/records" in html and "api/engines" in html


def test_engines_are_listed_by_node() -> None:
    """The fleet by node: each engine's view names the address of the Ray node it runs on, and engines of one node
    are listed next to each other (by node, then name), whatever order they were first seen in."""
    hub = MetricsHub()
    for name, ip in (("a", "10.0.0.3"), ("b", "10.0.0.2"), ("c", "10.0.0.3"), ("d", None)):
        hub.set_engine_status(status(name, 1) | ({"node_ip": ip} if ip else {}))
    assert [(e["node"], e["engine"]) for e in hub.engines()["engines"]] == [
        (None, "d"), ("10.0.0.2", "b"), ("10.0.0.3", "a"), ("10.0.0.3", "c")]


# ---- poller --------------------------------------------------------------------------------------
def test_poller_feeds_status_and_records_without_double_counting() -> None:
    hub = MetricsHub()
    records = [ok_record("e1", 1, 10.0).to_dict(), ok_record("e1", 2, 20.0).to_dict()]
    poller = Poller(hub, [lambda: (status("e1", 2), list(records))])
    assert poller.poll_once() == 2
    assert poller.poll_once() == 0  # the engine returns its whole history every time
    records.append(ok_record("e1", 3, 30.0).to_dict())
    assert poller.poll_once() == 1
    assert [r["version"] for r in hub.records()] == [1, 2, 3]
    engine = hub.engines()["engines"][0]
    assert (engine["engine"], engine["health"], engine["syncs"]) == ("e1", "ok", 3)


def test_poller_marks_a_failing_source_unreachable_and_keeps_polling_the_others() -> None:
    hub = MetricsHub()
    calls = {"n": 0}

    def flaky() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("actor died")
        return status("e1", 1), []

    poller = Poller(hub, [flaky, lambda: (status("e2", 1), [])])
    poller.poll_once()
    poller.poll_once()
    engines = {e["engine"]: e for e in hub.engines()["engines"]}
    assert engines["e1"]["health"] == "unreachable" and "actor died" in engines["e1"]["unreachable_reason"]
    assert engines["e2"]["health"] == "ok"


def test_poller_thread_runs_until_stopped() -> None:
    hub = MetricsHub()
    poller = Poller(hub, [lambda: (status("e1", 4), [ok_record("e1", 4, 1.0).to_dict()])], interval_s=0.01).start()
    try:
        for _ in range(200):
            if hub.engines()["engines"]:
                break
            time.sleep(0.01)
    finally:
        poller.stop()
    assert hub.engines()["engines"][0]["version"] == 4 and len(hub.records()) == 1


def test_named_actor_source_looks_the_actor_up_again_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[tuple[str, str | None]] = []

    class Method:
        def __init__(self, result: Any) -> None:
            self.result = result

        def remote(self) -> Any:
            return self.result

    class Actor:
        status = Method(status("engine-0", 2))
        records = Method([ok_record("engine-0", 2, 1.0).to_dict()])

    def get(refs: list[Any], timeout: float) -> list[Any]:
        if len(lookups) == 1:
            raise TimeoutError("no answer")
        return refs

    def get_actor(name: str, namespace: str | None = None) -> Actor:
        lookups.append((name, namespace))
        return Actor()

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=get, get_actor=get_actor))
    source = NamedActorSource("engine-0", "weight-bridge")
    with pytest.raises(TimeoutError):
        source()
    got_status, got_records = source()
    assert lookups == [("engine-0", "weight-bridge")] * 2
    assert got_status["version"] == 2 and got_records[0]["engine"] == "engine-0"


# ---- the page in a real browser ------------------------------------------------------------------
class Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag = tag
        self.attrs = attrs
        self.children: list[Node] = []
        self.text_parts: list[str] = []

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find_all(self, testid: str) -> list[Node]:
        return [n for n in self.walk() if n.attrs.get("data-testid") == testid]

    def find(self, testid: str) -> Node:
        found = self.find_all(testid)
        assert len(found) == 1, f"expected one data-testid={testid}, found {len(found)}"
        return found[0]

    @property
    def text(self) -> str:
        return " ".join(" ".join(p for n in self.walk() for p in n.text_parts).split())


class DomParser(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].text_parts.append(data)


def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    profile = tempfile.mkdtemp(prefix="wb-chromium-")
    try:
        return subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def rendered(service: DashboardService) -> Node:
    proc = chromium("--virtual-time-budget=5000", "--dump-dom", f"{service.url}/")
    assert proc.returncode == 0 and "<html" in proc.stdout, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    parser = DomParser()
    parser.feed(proc.stdout)
    return parser.root


@needs_chromium
def test_page_lists_each_engine_with_version_lag_health_and_rollouts(rendered: Node) -> None:
    rows = {r.attrs["data-engine"]: r for r in rendered.find_all("engine-row")}
    assert set(rows) == {"engine-a", "engine-b"}
    a, b = rows["engine-a"], rows["engine-b"]
    assert (a.find("engine-version").text, a.find("engine-lag").text, a.find("engine-health").text) == ("v3", "0", "ok")
    assert (b.find("engine-version").text, b.find("engine-lag").text, b.find("engine-health").text) == \
        ("v2", "1 behind", "degraded")
    assert (a.find("engine-rollouts").text, b.find("engine-rollouts").text) == ("96", "–")
    assert rendered.find("trainer-version").text == "v3"
    assert rendered.find("live-status").text.startswith("live")


@needs_chromium
def test_page_shows_each_syncs_bytes_on_the_wire_and_its_delta(rendered: Node) -> None:
    """The records table's Wire column: a delta sync's MB on the wire, its base version and changed share; a
    dense sync says so; a failed one shows nothing delivered."""
    rows = rendered.find_all("record-row")
    wire = {(r.attrs["data-engine"], r.find_all("record-wire")[0].text) for r in rows}
    assert ("engine-a", "20.0 · Δ v2 · 1.0%") in wire, wire
    assert ("engine-b", "dense") in wire and ("engine-b", "–") in wire, wire


@needs_chromium
def test_page_shows_the_density_per_tensor_group_of_each_engines_latest_delta(rendered: Node) -> None:
    """The engines table: engine-a's latest sync was a delta (its groups' densities and, on hover, MB on the wire
    over dense); engine-b's latest failed, so it shows none."""
    rows = {r.attrs["data-engine"]: r for r in rendered.find_all("engine-row")}
    a, b = rows["engine-a"].find("engine-groups"), rows["engine-b"].find("engine-groups")
    assert (a.text, b.text) == ("attn 1.20% · mlp 0.93%", "–")
    assert a.attrs["title"].split("\n") == ["attn: 5.0 / 500.0 MB", "mlp: 15.0 / 1500.0 MB"], a.attrs


@needs_chromium
def test_page_shows_a_red_alert_naming_the_stale_tensor(rendered: Node) -> None:
    banner = rendered.find("alert-banner")
    assert "hidden" not in banner.attrs and banner.attrs.get("role") == "alert"
    items = {i.attrs["data-kind"]: i.text for i in banner.find_all("alert-item")}
    assert STALE_TENSOR in items["stale"] and "engine-b" in items["stale"]
    assert "failed" in items and "v3" in items["failed"]


@needs_chromium
@pytest.mark.parametrize(("chart", "points"), [("chart-latency", 5), ("chart-throughput", 5), ("chart-probe", 5)])
def test_page_draws_each_chart(rendered: Node, chart: str, points: int) -> None:
    svg = rendered.find(chart)
    drawn = svg.find_all("chart-point")
    assert len(drawn) == points and svg.attrs["data-points"] == str(points)
    width = float(svg.attrs["viewbox"].split()[2])  # HTMLParser lower-cases attribute names
    assert all(0 < float(p.attrs["cx"]) < width for p in drawn)
    assert {p.attrs["data-engine"] for p in drawn} == {"engine-a", "engine-b"}
    assert len(svg.find_all("chart-line")) == 2
    if chart == "chart-latency":
        assert [f.attrs["data-engine"] for f in svg.find_all("chart-failure")] == ["engine-b"]
    if chart == "chart-probe":
        assert len(svg.find_all("chart-threshold")) == 1


@needs_chromium
def test_page_screenshot_is_kept_as_an_artefact(service: DashboardService) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    proc = chromium("--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1280,900", f"{service.url}/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1280, 900)
    assert len(data) > 30_000, "a screenshot this small is a blank page"


@needs_chromium
def test_page_hides_the_alert_banner_when_all_is_well() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("engine-a", 1, 100.0))
    hub.set_engine_status(status("engine-a", 1))
    with DashboardService(hub, port=0) as svc:
        proc = chromium("--virtual-time-budget=5000", "--dump-dom", f"{svc.url}/")
    parser = DomParser()
    parser.feed(proc.stdout)
    assert parser.root.find("live-status").text.startswith("live"), "the page did not load its data"
    assert "hidden" in parser.root.find("alert-banner").attrs
    assert parser.root.find_all("alert-item") == []
