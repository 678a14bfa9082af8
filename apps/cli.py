"""weight-bridge: stream trained policy weights into running vLLM engines, verified on every update.

    weight-bridge demo  [...]       run the end-to-end demo (trainer -> vLLM engines, verified)
    weight-bridge serve --port P    dashboard, JSON API and Prometheus /metrics
    weight-bridge bench [...]       measure sync latency and throughput
    weight-bridge health --url U    one-line verdict per engine; non-zero exit if any is unhealthy
    weight-bridge relay --engine E  a host-local relay: one network copy, shared memory to each engine
    weight-bridge keys NAME         make a CURVE key pair (NAME.key, NAME.key_secret) for receivers off loopback
    weight-bridge sweep-shm         remove /dev/shm segments of dead processes (killed vLLM engines included)

``weight-bridge <command> --help`` explains each command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bridge.config import load_config
from bridge.errors import BridgeError

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8321"
EXIT_UNHEALTHY = 1
EXIT_ERROR = 2


class CliError(BridgeError):
    """A command cannot run as asked (bad input file, missing module, unreachable service)."""


# ---- demo / bench: thin delegations ------------------------------------------------------------------
def _delegate(module: str, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Run ``module.main(argv)``; on ``--help`` print this command's summary before the module's own help."""
    wants_help = any(a in ("-h", "--help") for a in argv)
    if wants_help:
        parser.print_help()
        print(f"\nOptions of {module} (everything after the command is passed to it):\n", flush=True)
    try:
        entry: Callable[[list[str]], int | None] = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if exc.name not in (module, module.partition(".")[0]):
            raise
        if wants_help:
            print(f"  ({module} is not present in this installation)")
            return 0
        raise CliError(f"{module} is not importable ({exc}); it ships with the repository: run from its root "
                       f"(python -m apps.cli ...) after scripts/setup_env.sh") from exc
    try:
        return int(entry(argv) or 0)
    except SystemExit as exc:  # argparse --help / usage errors inside the delegate
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_ERROR)


def cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    return _delegate("apps.demo", args.parser, extra)


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    return _delegate("bench.run", args.parser, extra)


# ---- serve ----------------------------------------------------------------------------------------------
def load_records(path: Path) -> list[Any]:
    """SyncRecords from a JSONL file (one ``SyncRecord.to_dict()`` per line; blank lines skipped)."""
    from bridge.records import SyncRecord

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"cannot read records file {path}: {exc}") from exc
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(SyncRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError, AttributeError) as exc:
            raise CliError(f"{path}:{number}: not a sync record ({exc})") from exc
    return records


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    from apps.dashboard.poller import NamedActorSource, ReceiverSource, Source
    from apps.dashboard.service import DashboardService
    from apps.metrics import MetricsHub

    config = load_config(args.config)
    hub = MetricsHub.from_config(config)
    if args.records:
        records = load_records(Path(args.records))
        for record in records:
            hub.observe(record)
        logger.info("loaded %s records from %s", len(records), args.records)
    sources: list[Source] = []
    if args.actor:
        import ray

        ray.init(address=args.ray_address, namespace=args.ray_namespace, log_to_driver=False)
        sources = [NamedActorSource(name, args.ray_namespace) for name in args.actor]
    for endpoint in args.vllm_serve or ():
        sources.append(ReceiverSource(endpoint, curve_server_public=config.transport.curve_server_public,
                                      curve_client_secret=config.transport.curve_client_secret))
    host = args.host or config.serve.host
    port = config.serve.port if args.port is None else args.port
    service = DashboardService(hub, host=host, port=port, sources=sources, poll_interval_s=args.poll_interval)
    service.serve_forever(on_ready=lambda url: print(
        f"weight-bridge dashboard on {url}/  (metrics: {url}/metrics, JSON: {url}/api/records, "
        f"{url}/api/engines; Ctrl-C stops)", flush=True))
    return 0


# ---- health ---------------------------------------------------------------------------------------------
def _get_json(url: str, timeout_s: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CliError(f"{url}: {exc}") from exc


def verdict_line(engine: dict[str, Any]) -> str:
    health = str(engine.get("health", "unknown"))
    line = f"{health.upper():<11} {engine.get('engine')}  v{engine.get('version')}  lag {engine.get('lag')}"
    why = engine.get("degraded_reason") or engine.get("unreachable_reason")
    last = engine.get("last_sync") or {}
    if not why and last and not last.get("ok", True):
        why = f"last sync v{last.get('version')} failed: {last.get('reason')}"
    return f"{line}  {why}" if why else line


def cmd_health(args: argparse.Namespace, extra: list[str]) -> int:
    base = args.url.rstrip("/")
    try:
        _get_json(f"{base}/healthz", args.timeout)
        view = _get_json(f"{base}/api/engines", args.timeout)
    except CliError as exc:
        print(f"UNREACHABLE dashboard {base}: {exc}")
        return EXIT_ERROR
    engines = view.get("engines", [])
    if not engines:
        print(f"NO ENGINES  {base} knows no engine yet")
        return EXIT_UNHEALTHY
    for engine in engines:
        print(verdict_line(engine))
    return 0 if all(e.get("health") == "ok" for e in engines) else EXIT_UNHEALTHY


# ---- relay ----------------------------------------------------------------------------------------------
def cmd_relay(args: argparse.Namespace, extra: list[str]) -> int:
    """Runs until SIGINT (Ctrl-C) or SIGTERM (a service manager), then shuts the relay down: its staged
    segments are released. Both handlers are installed here: a process started in the background of a
    non-interactive shell inherits SIGINT ignored."""
    import signal
    import threading

    from inference_side.relay import Relay

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    relay = Relay(args.engine, load_config(args.config), name=args.name, port=args.port)
    print(f"weight-bridge relay {relay.endpoint()} -> {', '.join(args.engine)}  (Ctrl-C stops)", flush=True)
    try:
        stop.wait()
    finally:
        relay.shutdown()
    return 0


# ---- keys / sweep-shm -----------------------------------------------------------------------------------
def cmd_keys(args: argparse.Namespace, extra: list[str]) -> int:
    from bridge.curve import write_keypair

    public_path, secret_path, pair = write_keypair(args.dir, args.name)
    print(f"public key {pair.public}\n  {public_path}   (hand out: receivers list it in transport.curve_clients, "
          f"publishers set it as transport.curve_server_public)\n  {secret_path}   (keep, mode 0600: "
          f"transport.curve_server_secret of a receiver, or transport.curve_client_secret of a publisher)", flush=True)
    return 0


def cmd_sweep_shm(args: argparse.Namespace, extra: list[str]) -> int:
    from bridge.shm import sweep_orphans
    from bridge.vllm_shm import sweep_vllm_segments

    own = sweep_orphans()
    vllm = sweep_vllm_segments(min_age_s=args.min_age)
    print(f"removed {len(own.removed)} weight-bridge segments of dead processes ({own.bytes / 1e6:.1f} MB)")
    print(f"removed {len(vllm.removed)} vLLM segments no live process uses ({vllm.resident / 1e6:.1f} MB resident, "
          f"{vllm.bytes / 1e6:.1f} MB apparent){': ' + ' '.join(vllm.removed) if vllm.removed else ''}")
    print(f"kept {len(vllm.in_use)} vLLM segments in use and {len(vllm.young)} younger than {args.min_age:g} s")
    for name, why in vllm.not_cleaned:
        print(f"not cleaned: {name}: {why}")
    return EXIT_UNHEALTHY if vllm.not_cleaned else 0


# ---- parser ---------------------------------------------------------------------------------------------
Handler = Callable[[argparse.Namespace, list[str]], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weight-bridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, handler: Handler, summary: str, description: str, *, delegated: str = "",
            epilog: str | None = None) -> argparse.ArgumentParser:
        usage = f"%(prog)s [options of {delegated}]" if delegated else None
        p = sub.add_parser(name, help=summary, description=description, epilog=epilog, usage=usage,
                           add_help=not delegated, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler, parser=p, delegated=bool(delegated))
        return p

    add("demo", cmd_demo, "run the end-to-end demo: a trainer streams weights into running vLLM engines",
        "Run the end-to-end demo: start tiny vLLM engines, publish new policy weights from a trainer\n"
        "process, verify every update, and show the results. Implemented by apps.demo; every option\n"
        "after `demo` is passed to it.", delegated="apps.demo",
        epilog="example:\n  weight-bridge demo            # or: make demo")
    add("bench", cmd_bench, "measure sync latency and throughput (bench/run.py)",
        "Benchmark weight syncs: latency per phase and GB/s for several model sizes and transports.\n"
        "Implemented by bench/run.py; every option after `bench` is passed to it. Results go to\n"
        "bench/results/.", delegated="bench.run",
        epilog="example:\n  weight-bridge bench           # or: make bench")

    serve = add("serve", cmd_serve, "serve the dashboard, JSON API and Prometheus /metrics",
                "Serve the read-only dashboard (GET /), the JSON API (GET /api/records, /api/engines),\n"
                "Prometheus metrics (GET /metrics) and a liveness check (GET /healthz).\n"
                "Binds loopback unless --host says otherwise. Data comes from --records (a JSONL file)\n"
                "and/or from engines polled every --poll-interval seconds: named Ray actors (--actor) and\n"
                "engines behind `vllm serve` with the weight_bridge backend (--vllm-serve), asked over the\n"
                "receiver endpoint the trainer publishes to (no other port; CURVE keys from --config).",
                epilog="examples:\n"
                       "  weight-bridge serve --port 8321 --records artifacts/records.jsonl\n"
                       "  weight-bridge serve --host 0.0.0.0 --port 8321 --ray-address auto --actor engine-0\n"
                       "  weight-bridge serve --vllm-serve gpu-node-1:47310   # host:base_port of a vllm serve engine\n"
                       "then open http://127.0.0.1:8321/ or scrape http://127.0.0.1:8321/metrics")
    serve.add_argument("--port", type=int, help="TCP port (default: serve.port of the config, 8321; 0 = any free)")
    serve.add_argument("--host", help="address to bind (default: serve.host of the config, 127.0.0.1)")
    serve.add_argument("--records", metavar="FILE.jsonl", help="preload sync records: one SyncRecord dict per line")
    serve.add_argument("--config", metavar="FILE.yaml", help="config file (default: configs/default.yaml)")
    serve.add_argument("--actor", action="append", metavar="NAME",
                       help="name of a Ray InferenceActor to poll for status and records (repeat for several)")
    serve.add_argument("--vllm-serve", action="append", metavar="HOST:PORT",
                       help="an engine behind `vllm serve` (weight_bridge backend): its TP rank 0 receiver, "
                            "host:base_port or tcp://host:port as the trainer's WeightBridgeInitInfo names it "
                            "(any weight-bridge receiver answers too; repeat for several)")
    serve.add_argument("--ray-address", default="auto", metavar="ADDRESS", help="Ray cluster to join with --actor (default: auto)")
    serve.add_argument("--ray-namespace", default="weight-bridge", metavar="NAMESPACE",
                       help="Ray namespace of the --actor names (default: weight-bridge)")
    serve.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS",
                       help="seconds between polls of the engines (default: 1)")

    health = add("health", cmd_health, "check a running dashboard: one line per engine, exit 1 if any is unhealthy",
                 "Ask a running `weight-bridge serve` (GET /healthz and /api/engines) how its engines are.\n"
                 "Prints one line per engine: OK, DEGRADED (refuses requests until a complete update)\n"
                 "or UNREACHABLE, with version, lag behind the trainer and the reason.\n"
                 "Exit status: 0 all engines ok; 1 an engine is degraded or unreachable, or none is known;\n"
                 "2 the dashboard itself cannot be reached.",
                 epilog="example:\n  weight-bridge health --url http://127.0.0.1:8321")
    health.add_argument("--url", default=DEFAULT_URL, help=f"base URL of the dashboard (default: {DEFAULT_URL})")
    health.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="timeout of each request (default: 5)")
    relay = add("relay", cmd_relay, "run a host-local relay in front of this host's engines",
                "Run a host-local relay: publishers on other hosts send each update once, over tcp://, to\n"
                "the relay; it stages and verifies it in shared memory and forwards it to every --engine\n"
                "(their ipc:// or tcp:// endpoints on this host) over the shm transport. It answers ok\n"
                "only when every engine applied the version; a refusal names the engine and its reason.\n"
                "Prints its endpoint, then runs until interrupted.",
                epilog="example:\n  weight-bridge relay --engine ipc:///tmp/wb-ipc-a/receiver.sock "
                       "--engine ipc:///tmp/wb-ipc-b/receiver.sock")
    relay.add_argument("--engine", action="append", required=True, metavar="ENDPOINT",
                       help="endpoint of a local engine's receiver (repeat for each engine)")
    relay.add_argument("--config", metavar="FILE.yaml", help="config file (default: configs/default.yaml)")
    relay.add_argument("--name", metavar="NAME", help="the relay's publisher name (default: relay-<hostname>)")
    relay.add_argument("--port", type=int, default=0, metavar="PORT",
                       help="TCP port to bind on transport.bind_host (default: 0, any free port)")
    keys = add("keys", cmd_keys, "make a CURVE key pair for receivers and publishers off loopback",
               "Make a CURVE key pair and write it in ZeroMQ's certificate format: DIR/NAME.key (the public key,\n"
               "to hand out) and DIR/NAME.key_secret (the pair, mode 0600, to keep). A receiver bound to an\n"
               "address other than loopback needs its own pair (transport.curve_server_secret) and the public\n"
               "keys of the publishers it accepts (transport.curve_clients: keys, files or a directory of\n"
               "*.key files); a publisher sets the receivers' public key (transport.curve_server_public) and\n"
               "its own pair (transport.curve_client_secret). Each of these keys takes a z85 string or a path.\n"
               "Refuses to overwrite existing files.",
               epilog="example:\n  weight-bridge keys receivers --dir /etc/weight-bridge\n"
                      "  weight-bridge keys trainer --dir /etc/weight-bridge")
    keys.add_argument("name", metavar="NAME", help="file name of the pair (NAME.key, NAME.key_secret)")
    keys.add_argument("--dir", default=".", metavar="DIR", help="where to write the files (default: .)")
    sweep = add("sweep-shm", cmd_sweep_shm, "remove /dev/shm segments of dead processes, killed vLLM engines' included",
                "Remove what dead processes left in /dev/shm: weight-bridge's own segments whose maker died, and\n"
                "vLLM's own message queues and buffers (psm_*; vllm_dist_*-cpushm_* of CPU engines at TP >= 2)\n"
                "that no live process maps or holds open and that did not change for --min-age seconds (an\n"
                "engine killed with SIGKILL leaves them; a live engine's are kept). Receivers do this when they\n"
                "start (serve.sweep_vllm_shm). Prints what it removed and\n"
                "what it could not clean and why; exit status 1 when something is left that it could not judge\n"
                "or remove (run it as root, in the pid namespace of every process sharing this /dev/shm).",
                epilog="example:\n  weight-bridge sweep-shm")
    sweep.add_argument("--min-age", type=float, default=60.0, metavar="SECONDS",
                       help="leave vLLM segments that changed more recently (default: 60)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    if extra and not args.delegated:
        parser.error(f"unrecognized arguments for {args.command}: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args, extra)
    except BridgeError as exc:
        print(f"weight-bridge {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
