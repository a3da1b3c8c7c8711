"""The event log: every fact an agent learns, one JSON line each in `<log-dir>/events-<node>.jsonl`.

`schema` declares each event kind and its fields, once; `writer` is what the agent appends with;
`reader` loads and validates the files. The readers built on it: `report` (the job's story:
cycles, failures and their attribution, start-up), `node_view` (one node's state, live) and
`job_status` (the whole job's, for the status page and `ftrun status`). The command-line tools
(`ftrun.tools`) and the live view (`ftrun.observe`) both read through this package.

Torch-free and cheap to import: the tools run where training does not."""
