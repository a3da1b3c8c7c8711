"""The agent's part in in-process restart (`ftrun.inprocess`): deciding which rung of the
ladder recovers a fault (`ladder`, pure) and reaching the wrapped ranks' coordination store to
interrupt their iteration (`link`)."""
