"""Imports point down only: every module of the layered packages imports only the packages its
layer may use. Layers, lowest first:

    bridge                            wire messages, config, errors, checksums, records, shm, transports, sender
    trainer_side, inference_side      the two sides; they never import each other
    devtools                          cold-load oracle, tiny checkpoints: bridge and itself only
    apps                              CLI, demo, jobs, GRPO toy loop, metrics hub, dashboard
    bench, examples                   anything but tests
    tests                             anything

Every ``import`` and ``from ... import`` counts, also those inside functions and under TYPE_CHECKING;
relative imports are resolved against the importing module. Only our own packages count: stdlib and
third-party imports are ignored. Imports by name at run time (``importlib.import_module``, ``-m`` strings)
are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OURS = frozenset({"bridge", "trainer_side", "inference_side", "devtools", "apps", "bench", "examples", "tests"})

# package -> the packages (of ours) its modules may import; its own package is always listed
ALLOWED: dict[str, frozenset[str]] = {
    "bridge": frozenset({"bridge"}),
    "trainer_side": frozenset({"bridge", "trainer_side"}),
    "inference_side": frozenset({"bridge", "inference_side"}),
    "devtools": frozenset({"bridge", "devtools"}),
    "apps": frozenset({"bridge", "trainer_side", "inference_side", "devtools", "apps"}),
    "bench": OURS - {"tests"},
    "examples": OURS - {"tests"},
}

CHECKED = tuple(ALLOWED)  # the directories walked


def module_name(path: str) -> tuple[str, bool]:
    """The dotted module of a repository-relative ``path`` and whether it is a package (``__init__.py``)."""
    parts = Path(path).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def resolve(module: str, is_package: bool, level: int, target: str | None) -> str | None:
    """The absolute module a ``from`` import names; None when a relative one climbs above the top level."""
    if level == 0:
        return target
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level > len(package):
        return None
    base = package[:len(package) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def violations(path: str, source: str) -> list[str]:
    """One line per import in ``source`` (the file at repository-relative ``path``) that its layer forbids:
    ``path:line: `import statement` imports PACKAGE; LAYER may import only ...``."""
    layer = Path(path).parts[0]
    allowed = ALLOWED[layer]
    module, is_package = module_name(path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            targets: list[str | None] = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [resolve(module, is_package, node.level, node.module)]
        else:
            continue
        for target in targets:
            statement = ast.unparse(node)
            if target is None:
                found.append((node.lineno, f"{path}:{node.lineno}: `{statement}` climbs above the top-level package {layer}"))
                continue
            top = target.partition(".")[0]
            if top in OURS and top not in allowed:
                found.append((node.lineno, f"{path}:{node.lineno}: `{statement}` imports {top} ({target}); "
                                           f"{layer} may import only {', '.join(sorted(allowed))}"))
    return [line for _, line in sorted(found)]  # in file order (ast.walk goes breadth first)


# ---- the checker itself --------------------------------------------------------------------------
IN_FUNCTION = "def f():\n    {}\n"


@pytest.mark.parametrize(("path", "source", "flagged"), [
    ("bridge/wire.py", IN_FUNCTION.format("from inference_side.relay import Relay"), "inference_side"),
    ("bridge/wire.py", "from apps.cli import main\n", "apps"),
    ("bridge/wire.py", "import devtools.tiny_models\n", "devtools"),
    ("bridge/wire.py", "from bridge import errors\nfrom bridge.shm import sweep_orphans\n", None),
    ("bridge/wire.py", "import torch\nimport numpy.linalg\nfrom collections import abc\nfrom __future__ import annotations\n", None),
    ("trainer_side/publisher.py", "from bridge import wire\n", None),
    ("trainer_side/publisher.py", "import inference_side\n", "inference_side"),
    ("trainer_side/publisher.py", IN_FUNCTION.format("from inference_side.relay import Relay"), "inference_side"),
    ("inference_side/relay.py", "from trainer_side.publisher import WeightPublisher\n", "trainer_side"),
    ("inference_side/relay.py", "from bridge.sender import UpdateSender\n", None),
    ("devtools/coldload.py", "from bridge.errors import BridgeError\n", None),
    ("devtools/coldload.py", "from trainer_side import packing\n", "trainer_side"),
    ("devtools/coldload.py", "from apps import demo\n", "apps"),
    ("apps/cli.py", "from inference_side.relay import Relay\nfrom devtools.coldload import cold_outputs\n"
                    "from trainer_side import WeightPublisher\nfrom apps.metrics import MetricsHub\n", None),
    ("apps/cli.py", IN_FUNCTION.format("import bench.run"), "bench"),
    ("apps/ray_job.py", IN_FUNCTION.format("from examples.grpo_toy import train"), "examples"),
    ("bench/trainer.py", "from apps.job import report_line\nfrom examples import grpo_toy\n", None),
    ("bench/trainer.py", "from tests.conftest import ROOT\n", "tests"),
    ("examples/grpo_toy.py", "import tests\n", "tests"),
    # relative imports, resolved against the importing module
    ("bridge/transports/zmq_plane.py", "from ..shm import sweep_orphans\nfrom . import base\n", None),
    ("apps/dashboard/app.py", "from ..metrics import MetricsHub\nfrom .. import demo\n", None),
    ("inference_side/__init__.py", "from .relay import Relay\n", None),
    ("bridge/transports/zmq_plane.py", "from ...apps import cli\n", "above the top-level"),
])
def test_checker(path: str, source: str, flagged: str | None) -> None:
    found = violations(path, source)
    if flagged is None:
        assert found == []
    else:
        assert len(found) == 1, found
        assert found[0].startswith(f"{path}:"), found
        assert flagged in found[0], found


def test_checker_names_file_line_and_statement() -> None:
    (line,) = violations("bridge/wire.py", "import os\n\n" + IN_FUNCTION.format("from inference_side import server"))
    assert line == ("bridge/wire.py:4: `from inference_side import server` imports inference_side "
                    "(inference_side); bridge may import only bridge")


@pytest.mark.parametrize(("module", "is_package", "level", "target", "want"), [
    ("bridge.transports.zmq_plane", False, 1, "base", "bridge.transports.base"),
    ("bridge.transports.zmq_plane", False, 2, "shm", "bridge.shm"),
    ("bridge.transports", True, 1, "base", "bridge.transports.base"),
    ("bridge.transports", True, 2, None, "bridge"),
    ("bridge.wire", False, 2, "x", None),
    ("bridge.wire", False, 0, "inference_side.relay", "inference_side.relay"),
])
def test_resolve(module: str, is_package: bool, level: int, target: str | None, want: str | None) -> None:
    assert resolve(module, is_package, level, target) == want


# ---- the repository --------------------------------------------------------------------------------
def test_every_layered_package_exists() -> None:
    assert [p for p in CHECKED if not (ROOT / p).is_dir()] == []


@pytest.mark.parametrize("package", CHECKED)
def test_imports_point_down(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    found = [v for f in files for v in violations(f.relative_to(ROOT).as_posix(), f.read_text(encoding="utf-8"))]
    assert not found, f"{len(found)} import(s) in {package}/ point up or sideways:\n" + "\n".join(found)
