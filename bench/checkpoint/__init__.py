"""Local, replicated and global checkpoints, ETTR."""
