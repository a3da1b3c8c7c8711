"""Tools around the launcher, behind the `ftrun` console script (`ftrun report <log-dir>`).

Kept apart from the agent: they only read what launchers wrote (the events files), so they run
anywhere the log directory is visible, long after the job ended.
"""
