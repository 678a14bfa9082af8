#!/usr/bin/env bash
# System packages the tests need beyond .venv: Debian's chromium for the headless dashboard test
# (tests/test_dashboard.py skips its browser checks when /usr/bin/chromium is absent). Idempotent.
# Needs root (apt-get); run it before `make test`.
set -euo pipefail
command -v chromium >/dev/null 2>&1 || {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq chromium
}
chromium --version 2>/dev/null || true
