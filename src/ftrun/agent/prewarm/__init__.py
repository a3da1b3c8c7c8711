"""One fork server per node: import torch once, fork every worker from that warm interpreter.

`forkserver.py` is the server process (single-threaded, never touches CUDA), `wire.py` its
protocol; `client.py` is the agent's side (`ForkServer`; a spawn in flight is a
`spawn_request.SpawnRequest`, and `start_env.py` says which workers the server may fork),
`forked.py` the workers it forks (`ForkedWorker`, a Popen look-alike); `launch.py` starts the
server, spawned or forked from the agent (`inherit.py`: the fork's side). In each child,
`child.py` becomes the worker: `binding.py` binds it (--numa-binding), `pools.py` sizes its
thread pools, `marks.py` records its start-up.

This package's import stays empty: `python -m ftrun.agent.prewarm.forkserver` imports it first,
and whatever it imported would end up in every forked worker (and `client` brings psutil,
subprocess and logging with it).
"""
