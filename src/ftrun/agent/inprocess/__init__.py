"""The agent's part in in-process restart (`ftrun.inprocess`, which the agent never imports:
`ftrun.inprocess_protocol` is what both sides share): deciding which rung of the ladder
recovers a fault (`ladder`, pure), the ranks' reports and the way to interrupt them (`link`),
and carrying out the in-process rungs (`effects`)."""
