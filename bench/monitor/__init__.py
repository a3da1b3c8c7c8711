"""Heartbeats, sections, straggler detection, re-runs, attribution, the live view."""
