"""Start-up and recovery against torchrun and NVRx."""
