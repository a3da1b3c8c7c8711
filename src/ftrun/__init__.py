"""ftrun: a fault-tolerant launcher and supervisor for distributed PyTorch training.

Importing this package must stay cheap and must not import torch: the in-worker client
(`ftrun.client_lib`) is imported by training scripts before they choose their backends.
"""

__version__ = "0.1.0"
