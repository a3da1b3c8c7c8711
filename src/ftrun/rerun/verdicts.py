"""How a rank tells its node's launcher about a rejected result: one small JSON file per fact in
`<FTRUN_IPC_DIR>/rerun/` (the job's 0700 directory), read by the rerun node service.

Facts (`kind`):
- `suspect`: this rank's result was rejected and re-running the step in place reproduced it;
  the rank's node must not re-run it (it steps aside for the next cycle);
- `verdict`: a diagnosis (`RerunDiagnostic` value): `transient_error` (the in-place re-run
  differed), `persistent_error` (the re-run elsewhere differed: the suspect node's hardware),
  `correct_result` (the re-run elsewhere reproduced it).

Standard library only, no torch: the launcher's side reads these too. Under plain torchrun
(no `FTRUN_IPC_DIR`) nothing is written and the state machine works on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ftrun.environment import Env
from ftrun.owned_dir import replace_file

DIR = "rerun"
_MAX_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class RerunFact:
    kind: str
    """'suspect' or 'verdict'."""
    rank: int
    node: str
    iteration: int
    message: str
    diagnostic: str = ""
    suspect_node: str = ""
    """For a verdict after a re-run elsewhere: the node whose result was rejected."""
    initial: str = ""
    rerun: str = ""
    """The two results, as text (evidence)."""
    fatal: bool = True


def tell(fact: RerunFact, environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """Write a fact for this node's launcher (atomic rename); nothing without a launcher."""
    ipc = environ.get(Env.JOB_DIR)
    if not ipc:
        return
    folder = Path(ipc) / DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    name = f"{fact.kind}-rank{fact.rank}-iter{fact.iteration}-{os.getpid()}.json"
    replace_file(folder / name, json.dumps(dataclasses.asdict(fact)))


def collect(job_dir: Path) -> list[RerunFact]:
    """Take the facts written so far (each is read once: the file is removed)."""
    folder = job_dir / DIR
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    facts = []
    for name in names:
        path = folder / name
        try:
            with path.open("rb") as f:
                raw: Any = json.loads(f.read(_MAX_BYTES))
            fact = RerunFact(**raw)
            if _well_typed(fact):
                facts.append(fact)
        except (OSError, ValueError, TypeError):
            pass  # a torn or foreign file: ignored, and removed below
        path.unlink(missing_ok=True)
    return facts


def _well_typed(fact: RerunFact) -> bool:
    fields = {f.name: f.type for f in dataclasses.fields(RerunFact)}
    kinds = {"str": str, "int": int, "bool": bool}
    return all(type(getattr(fact, name)) is kinds[kind] for name, kind in fields.items())
