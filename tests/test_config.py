"""The config tree: the default file loads; unknown keys, bad literals and bad values are ConfigErrors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bridge.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    BridgeConfig,
    TransportConfig,
    config_from_dict,
    load_config,
)
from bridge.errors import ConfigError


def test_default_file_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert DEFAULT_CONFIG_PATH.is_file()
    cfg = load_config()
    assert cfg == load_config(DEFAULT_CONFIG_PATH)
    assert cfg == BridgeConfig()  # the file states the built-in defaults
    assert cfg.transport.kind == "zmq"
    assert cfg.transport.bind_host == "127.0.0.1"
    assert cfg.transport.bucket_bytes == 64 << 20
    assert cfg.sync.nonfinite == "reject"


def test_same_host_file_changes_only_the_transport_kind() -> None:
    cfg = load_config(DEFAULT_CONFIG_PATH.parent / "same-host.yaml")
    assert cfg.transport.kind == "shm"
    assert dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, kind="zmq")) == BridgeConfig()


def test_env_var_chooses_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("transport:\n  kind: shm\n  depth: 4\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    cfg = load_config()
    assert cfg.transport.kind == "shm"
    assert cfg.transport.depth == 4
    assert cfg.deadlines == BridgeConfig().deadlines


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == BridgeConfig()


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("transport: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path)


def test_config_is_frozen() -> None:
    cfg = BridgeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.transport.kind = "shm"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sync = cfg.sync  # type: ignore[misc]


BAD: list[tuple[str, Any, str]] = [
    ("unknown-top-key", {"transprot": {}}, "config: unknown key(s) ['transprot']"),
    ("unknown-nested-key", {"transport": {"bucket_size": 3}}, "config.transport: unknown key(s) ['bucket_size']"),
    ("unknown-two-keys", {"sync": {"zz": 1, "aa": 2}}, "unknown key(s) ['aa', 'zz']"),
    ("bad-literal-kind", {"transport": {"kind": "carrier-pigeon"}}, "config.transport.kind: 'carrier-pigeon' is not one of"),
    ("bad-literal-mode", {"sync": {"mode": "eventually"}}, "config.sync.mode: 'eventually' is not one of ['staged', 'streaming']"),
    ("bad-literal-nonfinite", {"sync": {"nonfinite": True}}, "config.sync.nonfinite: True is not one of"),
    ("bucket-mb-zero", {"transport": {"bucket_mb": 0}}, "transport.bucket_mb must be > 0, got 0"),
    ("bucket-mb-negative", {"transport": {"bucket_mb": -1.5}}, "transport.bucket_mb must be > 0, got -1.5"),
    ("depth-zero", {"transport": {"depth": 0}}, "transport.depth must be >= 1, got 0"),
    ("section-not-map", {"transport": "zmq"}, "config.transport: expected a mapping, got str"),
    ("section-null", {"deadlines": None}, "config.deadlines: expected a mapping, got NoneType"),
    ("top-level-list", ["transport"], "config: expected a mapping, got list"),
    ("int-gets-float", {"serve": {"port": 8321.5}}, "config.serve.port: expected int, got 8321.5"),
    ("int-gets-bool", {"transport": {"depth": True}}, "config.transport.depth: expected int, got True"),
    ("int-gets-str", {"sync": {"max_tensors": "many"}}, "config.sync.max_tensors: expected int, got 'many'"),
    ("bool-gets-str", {"router": {"audit": "yes"}}, "config.router.audit: expected bool, got 'yes'"),
    ("str-gets-int", {"serve": {"host": 127}}, "config.serve.host: expected str, got 127"),
    ("float-gets-str", {"deadlines": {"connect_s": "30s"}}, "config.deadlines.connect_s: expected float, got '30s'"),
    ("float-gets-bool", {"probe": {"max_mean_abs_logprob_diff": True}}, "expected float, got True"),
    ("bucket-mb-str", {"transport": {"bucket_mb": "64"}}, "config.transport.bucket_mb: expected float, got '64'"),
    ("host-copy-streaming", {"sync": {"host_copy": True, "mode": "streaming"}}, "sync.host_copy is only supported with sync.mode: staged"),
    ("idle-spin-negative", {"serve": {"worker_idle_spin_s": -0.1}}, "serve.worker_idle_spin_s must be null or seconds >= 0, got -0.1"),
    ("idle-spin-str", {"serve": {"worker_idle_spin_s": "1s"}}, "serve.worker_idle_spin_s must be null or seconds >= 0, got '1s'"),
    ("idle-spin-bool", {"serve": {"worker_idle_spin_s": False}}, "serve.worker_idle_spin_s must be null or seconds >= 0, got False"),
    ("core-spin-negative", {"serve": {"engine_core_spin_s": -1}}, "serve.engine_core_spin_s must be null, \"auto\" or seconds >= 0, got -1"),
    ("core-spin-word", {"serve": {"engine_core_spin_s": "fast"}}, "serve.engine_core_spin_s must be null, \"auto\" or seconds >= 0, got 'fast'"),
    ("core-spin-inf", {"serve": {"engine_core_spin_s": float("inf")}}, "serve.engine_core_spin_s must be null, \"auto\" or seconds >= 0, got inf"),
    ("delta-compress-word", {"sync": {"delta_compress": "zstd"}}, "sync.delta_compress"),
    ("reload-threads-zero", {"serve": {"reload_threads": 0}}, 'serve.reload_threads must be "auto" or an integer >= 1, got 0'),
    ("reload-threads-word", {"serve": {"reload_threads": "many"}}, 'serve.reload_threads must be "auto" or an integer >= 1, got \'many\''),
    ("reload-threads-bool", {"serve": {"reload_threads": True}}, 'serve.reload_threads must be "auto" or an integer >= 1, got True'),
]


@pytest.mark.parametrize("threads", ["auto", 1, 4])
def test_serve_reload_threads_reaches_every_workers_options(threads: Any) -> None:
    cfg = config_from_dict({"serve": {"reload_threads": threads}})
    assert cfg.worker_options()["reload_threads"] == threads


@pytest.mark.parametrize(("setting", "all_on_this_host", "compresses"), [
    ("auto", True, False), ("auto", False, True), (True, True, True), (True, False, True), (False, True, False),
    (False, False, False),
])
def test_sync_delta_compress_compresses_unless_every_engine_is_on_this_host(setting: Any, all_on_this_host: bool,
                                                                           compresses: bool) -> None:
    cfg = config_from_dict({"sync": {"delta_compress": setting}})
    assert cfg.sync.compresses_patches(all_on_this_host) is compresses


@pytest.mark.parametrize(("data", "phrase"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_config_from_dict_rejects(data: Any, phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert phrase in str(info.value)


def test_unknown_key_in_file_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("sync:\n  verify_checksum: false\n")  # missing 's'
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "verify_checksum'" in str(info.value)
    assert "verify_checksums" in str(info.value)  # the known keys are listed


def test_bad_literal_in_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("transport:\n  kind: carrier-pigeon\n")
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        load_config(path)


@pytest.mark.parametrize(("section", "key", "value"), [
    ("transport", "bucket_mb", 1),
    ("deadlines", "connect_s", 5),
    ("probe", "max_mean_abs_logprob_diff", 0),
])
def test_int_where_float_expected_is_ok(section: str, key: str, value: int) -> None:
    cfg = config_from_dict({section: {key: value}})
    got = getattr(getattr(cfg, section), key)
    assert got == value
    assert type(got) is float


def test_values_are_taken() -> None:
    cfg = config_from_dict({"transport": {"kind": "nccl", "bucket_mb": 0.5}, "sync": {"mode": "streaming", "nonfinite": "allow"},
                            "serve": {"port": 9000}, "router": {"audit": False}})
    assert cfg.transport.kind == "nccl"
    assert cfg.transport.bucket_bytes == 1 << 19
    assert cfg.sync.mode == "streaming" and cfg.sync.nonfinite == "allow"
    assert cfg.serve.port == 9000
    assert cfg.router.audit is False
    assert cfg.router.enabled is True  # untouched keys keep defaults


def test_none_and_empty_give_defaults() -> None:
    assert config_from_dict(None) == BridgeConfig()
    assert config_from_dict({}) == BridgeConfig()


def test_replace_sections() -> None:
    cfg = BridgeConfig()
    new = cfg.replace(transport={"kind": "shm"}, sync=dataclasses.replace(cfg.sync, nonfinite="allow"))
    assert new.transport.kind == "shm" and new.transport.bucket_mb == cfg.transport.bucket_mb
    assert new.sync.nonfinite == "allow"
    assert cfg.transport.kind == "zmq"  # the original is unchanged
    with pytest.raises(ConfigError, match="bucket_mb must be > 0"):
        cfg.replace(transport={"bucket_mb": -1})


def test_transport_config_validates_directly() -> None:
    with pytest.raises(ConfigError, match="depth must be >= 1"):
        TransportConfig(depth=0)
