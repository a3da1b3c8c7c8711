"""What broke, from the evidence a cycle leaves: each failure named as a signature
(`attribution`), the evidence gathered as the cycle ends (`evidence`: stderr tails, hang
verdicts, the flight recorders' dumps via `flight_recorder` and `collectives`), the job's history
of failures judged (`repeats`, which `agent.policy` applies) and the cycle's events and log lines
(`reporting`)."""
