"""The agent's decisions, pure: no store, no process, no clock. What the loop observed
(`observed`: events and facts) goes in, an action comes out (`policy`); beside it the names of
failures (`attribution`, `collectives`), the judgement of repeats (`repeats`), the in-process
ladder (`ladder`) and the agent's lifecycle (`state`). Nothing here imports the rest of the
agent: each decision is unit-tested without processes."""
