#!/usr/bin/env bash
# Install Debian's prometheus (for promtool: the alert rules' checks and unit tests,
# tests/test_alert_rules.py), through tests/apt-install.sh. Does nothing when promtool is on
# PATH already. Never fails the build (the tests then skip, saying why).
#
#   bash tests/prometheus/install-prometheus.sh
set -uo pipefail
exec bash "$(dirname "$0")/../apt-install.sh" prometheus promtool prometheus
