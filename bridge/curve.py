"""CURVE on the ZMQ sockets between publishers and receivers: key pairs and key files, the publishers a
receiver accepts, and the rule that a receiver bound off loopback authenticates its peers.

Keys are ZeroMQ's: 40-character z85 strings. Every key in the config (``transport.curve_*``) is either such a
string or the path of a key file as ``weight-bridge keys`` writes it (ZeroMQ's certificate format, as
``zmq.auth.create_certificates``): ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair (mode 0600).

A receiver with ``transport.curve_server_secret`` takes CURVE connections only: a peer must know its public
key. With ``transport.curve_clients`` it accepts only the publishers whose public key is listed there (checked
by a ZAP handler in the receiver's process: ``zmq.auth``'s authenticator, one per ZMQ context, one domain per
receiver); any other key is refused at the handshake and never reaches the engine. A publisher presents
``transport.curve_client_secret`` (a fresh key per connection when empty, which only receivers without a
client list accept). Binding a receiver to an address other than loopback needs both, or the explicit
``transport.allow_unauthenticated: true``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.config import TransportConfig
from bridge.errors import ConfigError, TransportError

logger = logging.getLogger(__name__)

Z85_KEY_LEN = 40
_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def is_z85_key(value: str) -> bool:
    """Whether ``value`` is a CURVE key written in z85 (40 characters of its alphabet)."""
    return len(value) == Z85_KEY_LEN and set(value) <= _Z85


@dataclass(frozen=True)
class KeyPair:
    public: str  # z85
    secret: str  # z85


def new_keypair() -> KeyPair:
    import zmq

    public, secret = zmq.curve_keypair()
    return KeyPair(public.decode(), secret.decode())


_BANNER = "#   ZeroMQ CURVE {what} Certificate, written by weight-bridge keys\n{warning}\n"


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path, KeyPair]:
    """Make a key pair and write ``DIRECTORY/NAME.key`` (the public key, to hand out) and
    ``DIRECTORY/NAME.key_secret`` (the pair, mode 0600, to keep), in ZeroMQ's certificate format
    (``zmq.auth.load_certificate`` reads both). Refuses to overwrite either file."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r}: give a plain file name such as trainer or node-1")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise ConfigError(f"{path} exists already: remove it or choose another name")
    pair = new_keypair()
    texts = {
        secret_path: (_BANNER.format(what="**Secret**", warning="#   Keep it: whoever reads it can act as its owner.")
                      + f'curve\n    public-key = "{pair.public}"\n    secret-key = "{pair.secret}"\n', 0o600),
        public_path: (_BANNER.format(what="Public", warning="#   Hand it to the peers that must accept its owner.")
                      + f'curve\n    public-key = "{pair.public}"\n', 0o644),
    }
    for path, (text, mode) in texts.items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return public_path, secret_path, pair


def load_key(value: str, where: str, secret: bool) -> str:
    """The z85 key ``value`` names: ``value`` itself when it is a z85 key, else the key file at that path (the
    secret key of a ``.key_secret`` file when ``secret``, otherwise the file's public key). ``where`` names the
    config key in errors."""
    if is_z85_key(value):
        return value
    from zmq.auth import load_certificate

    try:
        public, secret_key = load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {value!r} is neither a z85 key (40 characters) nor a readable key file: {exc}") from exc
    key = secret_key if secret else public
    if key is None:
        raise ConfigError(f"{where}: {value} holds no secret key (give the NAME.key_secret file, not NAME.key)")
    text = key.decode()
    if not is_z85_key(text):
        raise ConfigError(f"{where}: the key in {value} is not a z85 key")
    return text


def load_public_keys(values: Iterable[str], where: str) -> frozenset[str]:
    """Public keys from ``values``: each a z85 key, a key file, or a directory whose ``*.key`` files are read."""
    keys: set[str] = set()
    for value in values:
        if not is_z85_key(value) and Path(value).is_dir():
            files = sorted(Path(value).glob("*.key"))
            if not files:
                raise ConfigError(f"{where}: the directory {value} holds no *.key file")
            keys.update(load_key(str(f), where, secret=False) for f in files)
        else:
            keys.add(load_key(value, where, secret=False))
    return frozenset(keys)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (a name counts when every address it has is)."""
    if host in ("", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def on_this_host(endpoint: str) -> bool:
    """Whether a publisher reaches ``endpoint`` without leaving this host: ``ipc://`` and ``inproc://``, or
    ``tcp://`` to a loopback host (``is_loopback``). Anything else counts as another host, this host's own
    non-loopback addresses included."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or not rest:
        return False
    host = rest.rsplit(":", 1)[0]  # tcp://HOST:PORT, an IPv6 host in brackets
    return bool(host) and is_loopback(host)


@dataclass(frozen=True)
class ServerCurve:
    """A receiver's CURVE: its key pair and the publishers' public keys it accepts (empty: any peer that
    knows ``public``)."""

    public: str
    secret: str
    clients: frozenset[str]


@dataclass(frozen=True)
class ClientCurve:
    """A publisher's CURVE: the receivers' public key and the key it presents; ``own`` is False for a fresh
    key made for this publisher alone (accepted only by receivers without a client list)."""

    server_public: str
    public: str
    secret: str
    own: bool


def server_curve(tcfg: TransportConfig) -> ServerCurve | None:
    """The receiver's CURVE from ``tcfg`` (None: plain ZMQ). Raises ConfigError for a key that cannot be read,
    a public key that is not the secret's, a client list without a server key, and a receiver that would
    bind an address other than loopback without authenticating publishers (unless ``allow_unauthenticated``)."""
    import zmq

    curve = None
    if tcfg.curve_server_secret:
        secret = load_key(tcfg.curve_server_secret, "transport.curve_server_secret", secret=True)
        public = zmq.curve_public(secret.encode()).decode()
        if tcfg.curve_server_public and load_key(tcfg.curve_server_public, "transport.curve_server_public",
                                                 secret=False) != public:
            raise ConfigError("transport.curve_server_public is not the public half of transport.curve_server_secret")
        curve = ServerCurve(public, secret, load_public_keys(tcfg.curve_clients, "transport.curve_clients"))
    elif tcfg.curve_clients:
        raise ConfigError("transport.curve_clients needs transport.curve_server_secret (the receiver's own key)")
    if not is_loopback(tcfg.bind_host) and not tcfg.allow_unauthenticated and (curve is None or not curve.clients):
        missing = "transport.curve_server_secret and transport.curve_clients" if curve is None else "transport.curve_clients"
        raise ConfigError(
            f"transport.bind_host is {tcfg.bind_host!r}, not loopback, and without {missing} the receiver would "
            f"take updates from any peer that reaches it: make keys with `weight-bridge keys` and set both "
            f"(docs/configuration.md), or set transport.allow_unauthenticated: true on a network you trust")
    return curve


def client_curve(tcfg: TransportConfig, server_public: str | None = None) -> ClientCurve | None:
    """The publisher's CURVE towards receivers whose public key is ``server_public`` (default
    ``transport.curve_server_public``; empty: plain ZMQ)."""
    import zmq

    server = tcfg.curve_server_public if server_public is None else server_public
    if not server:
        return None
    server = load_key(server, "transport.curve_server_public", secret=False)
    if tcfg.curve_client_secret:
        secret = load_key(tcfg.curve_client_secret, "transport.curve_client_secret", secret=True)
        return ClientCurve(server, zmq.curve_public(secret.encode()).decode(), secret, own=True)
    pair = new_keypair()
    return ClientCurve(server, pair.public, pair.secret, own=False)


def secure_client(sock: Any, curve: ClientCurve | None) -> None:
    """Set a DEALER's CURVE options (before it connects)."""
    if curve is not None:
        sock.curve_serverkey = curve.server_public.encode()
        sock.curve_publickey = curve.public.encode()
        sock.curve_secretkey = curve.secret.encode()


class _Authority:
    """The ZAP handler of one ZMQ context: one ``zmq.auth`` authenticator thread, one domain per receiver,
    each with the public keys it accepts."""

    def __init__(self, ctx: Any) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        self.clients: dict[str, frozenset[bytes]] = {}
        self.auth = ThreadAuthenticator(ctx)
        try:
            self.auth.start()
        except zmq.ZMQError as exc:  # another ZAP handler serves this context already
            raise TransportError(f"cannot start the CURVE authenticator (ZAP handler) of this process: {exc}") from exc

    def callback(self, domain: str, key: bytes) -> bool:
        if domain == "*":  # a CURVE receiver of this context without a client list: any key is accepted
            return True
        ok = key in self.clients.get(domain, frozenset())
        if not ok:
            logger.warning("refused a publisher at the CURVE handshake: its key %s is not in transport.curve_clients",
                           key.decode(errors="replace"))
        return ok


_authorities: dict[int, _Authority] = {}
_authority_lock = threading.Lock()
_domains = iter(range(1, 1 << 62))


def secure_server(sock: Any, ctx: Any, curve: ServerCurve | None) -> str:
    """Make a ROUTER of context ``ctx`` a CURVE server (before it binds); with a client list, register it with
    the context's ZAP handler under a domain of its own (returned; ``release_server`` drops it) and refuse every
    handshake when no handler answers."""
    import zmq

    if curve is None:
        return ""
    sock.curve_server = True
    sock.curve_secretkey = curve.secret.encode()
    sock.curve_publickey = curve.public.encode()
    if not curve.clients:
        return ""
    with _authority_lock:
        authority = _authorities.get(id(ctx))
        if authority is None:
            authority = _authorities[id(ctx)] = _Authority(ctx)
            authority.auth.configure_curve_callback("*", authority)
        domain = f"weight-bridge-{os.getpid()}-{next(_domains)}"
        authority.clients[domain] = frozenset(k.encode() for k in curve.clients)
        authority.auth.configure_curve_callback(domain, authority)
    sock.zap_domain = domain.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return domain


def release_server(ctx: Any, domain: str) -> None:
    """Forget a receiver's client list (its socket is closed)."""
    if not domain:
        return
    with _authority_lock:
        authority = _authorities.get(id(ctx))
        if authority is not None:
            authority.clients.pop(domain, None)
            authority.auth.credentials_providers.pop(domain, None)


def watch(sock: Any) -> Any:
    """A monitor socket reporting ``sock``'s failed security handshakes (read with ``handshake_failure``)."""
    import zmq

    return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_failure(monitor: Any, curve: ClientCurve | None, peer: str = "engine") -> str:
    """Why the security handshake with ``peer`` failed, from the events ``monitor`` received so far (empty
    string when none did), in words that say what to set."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    why = ""
    while monitor.poll(0):
        event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
        # the side that notices a mechanism mismatch first closes: the other may see a bare failure (NO_DETAIL)
        if curve is None:
            why = ("security mechanisms differ (CURVE on one side only): set transport.curve_server_public "
                   f"to the {peer}'s CURVE public key")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = (f"security mechanisms differ (CURVE on one side only): this side uses CURVE and the {peer} does "
                   "not (give it transport.curve_server_secret, or clear transport.curve_server_public here)")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if curve is not None and curve.own:
                why = (f"CURVE authentication failed: the {peer} does not accept this side's key {curve.public} "
                       "(add it to the receiver's transport.curve_clients)")
            else:
                why = (f"CURVE authentication failed: the {peer} accepts only the keys in its transport.curve_clients "
                       "and this side has none (set transport.curve_client_secret to a key made with "
                       "`weight-bridge keys` whose public half the receiver lists)")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            why = (f"CURVE authentication failed: wrong server key (transport.curve_server_public is not the "
                   f"{peer}'s public key), or the {peer} does not use CURVE")
    return why


def send_connected(sock: Any, parts: list[Any], within_s: float, check_refused: Callable[[], None], peer: str) -> Any:
    """Send the multipart message ``parts`` on the client socket ``sock`` (DEALER), waiting at most ``within_s``
    seconds for a connection to take it; return the tracker of the last part when there are several parts (None
    for one). A connecting socket whose security handshake failed has no connection, for good: a blocking send
    would wait forever. So every wait calls ``check_refused()``, which raises when the handshake failed (from
    ``handshake_failure`` of the socket's monitor), and DeadlineExceeded names ``peer`` when no connection took
    the message in time. The message goes whole or not at all, except when the connection closes between its
    parts (TransportError; ZeroMQ drops what went)."""
    import zmq

    from bridge.errors import DeadlineExceeded

    more = zmq.SNDMORE if len(parts) > 1 else 0
    end = None
    while True:
        try:  # ZeroMQ checks for room at a message's first part only
            sock.send(parts[0], zmq.NOBLOCK | more, copy=False)
            break
        except zmq.Again:
            now = time.monotonic()
            end = now + within_s if end is None else end
            check_refused()
            if now >= end:
                raise DeadlineExceeded(f"{peer} took no message within {within_s}s: no connection") from None
            time.sleep(0.005)  # poll(POLLOUT) is no help: it says writable while the refused session goes away
    tracker = None
    for i, part in enumerate(parts[1:], 2):
        last = i == len(parts)
        try:
            tracker = sock.send(part, zmq.NOBLOCK | (0 if last else zmq.SNDMORE), copy=False, track=last)
        except zmq.Again:
            raise TransportError(f"the connection to {peer} closed in the middle of a message") from None
    return tracker
