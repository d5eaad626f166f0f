#!/usr/bin/env bash
# Install headless Chromium and its WebDriver from Debian's packages, for tests/serve/test_serve_docs_browser.py
# (memfit serve's /docs page in a real browser; the test skips, saying why, where no browser is installed).
# Needs root (or sudo); selenium itself comes with the test extras (scripts/test.sh).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium chromium-driver
chromium --version
chromedriver --version
