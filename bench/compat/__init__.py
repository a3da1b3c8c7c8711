"""NVRx's own examples under ftrun."""
