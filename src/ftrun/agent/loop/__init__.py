"""The agent's loop: the executor (`node`) that turns what happens into the policy's events
(`inbox`, `inbox_events`, `facts`), asks `decisions.policy`, and carries the actions out
(`inprocess_effects`); the runtime it holds for the job's life (`runtime`); the evidence and
reports a cycle leaves (`evidence`, `flight_recorder`, `reporting`). The only part of the agent
that holds the runtime. Light on purpose: the CLI imports `inbox` before torch."""
