"""NUMA binding."""
