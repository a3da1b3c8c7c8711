"""The training scripts the launchers run (by path, as users run theirs)."""
