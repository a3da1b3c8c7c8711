#!/usr/bin/env bash
# Install Debian's chromium for tests/test_status_browser.py (the status page in a real,
# headless browser), through tests/apt-install.sh. Does nothing when a chromium binary is there
# already: the test looks for FTRUN_CHROMIUM, then /usr/bin/chromium, then
# /usr/bin/chromium-browser. Never fails the build (the test then skips, saying why).
#
#   bash tests/browser/install-chromium.sh
set -uo pipefail

for bin in "${FTRUN_CHROMIUM:-}" /usr/bin/chromium-browser; do
  [[ -n $bin && -x $bin ]] && exit 0
done
exec bash "$(dirname "$0")/../apt-install.sh" chromium /usr/bin/chromium chromium fonts-dejavu-core
