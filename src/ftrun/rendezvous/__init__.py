"""Rendezvous: barrier (v2, default) and dynamic (v1), plus job-wide control via the store."""
