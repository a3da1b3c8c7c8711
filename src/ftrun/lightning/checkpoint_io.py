"""`HierarchicalCheckpointIO`: frequent local checkpoints through `ftrun.checkpointing`, durable
global ones through the trainer's own IO, and a resume from the newest good copy of either.

```python
io = HierarchicalCheckpointIO("/local/ckpt", every_n_train_steps=50)
trainer = Trainer(plugins=[io], callbacks=[io.callback(), ModelCheckpoint(dirpath=ckpt_dir, ...)])
trainer.fit(model, ckpt_path=io.resume_path(ckpt_dir))
```

- **Local** (`io.callback()`): every `every_n_train_steps` steps, every rank saves its own copy
  of the Lightning checkpoint dict with `LocalCheckpointManager` (node memory under ft_launcher,
  kept by the agent across worker restarts and replicated to peers with `repl_strategy`; files
  under `local_ckpt_dir` under torchrun). The dict comes from the trainer's
  `_checkpoint_connector.dump_checkpoint()` (Lightning's only way to build it on every rank: its
  `save_checkpoint` hands it to the IO on rank 0 alone under DDP), so callbacks'
  `on_save_checkpoint` run as for any save. `state_codec` makes it storable.
- **Global**: `save_checkpoint`/`load_checkpoint`/`remove_checkpoint` go to `checkpoint_io`
  (default `TorchCheckpointIO`), and each saved file's `global_step` is noted in
  `<dir>/.ftrun-steps.json` so a resume need not open every file to rank them.
- **Resume**: `resume_path(*dirs)` (call it before `fit`, on every rank; no collective) returns
  `NEWEST` when some copy exists, else None. `load_checkpoint(NEWEST)` then loads, newest step
  first and local before global at the same step: the local iteration every rank has (under
  ft_launcher the agents decided it before the workers started), else each global file in turn,
  skipping one that fails to load (every rank reads the same file, so all skip it). Under
  ft_launcher a corrupt local part is raised, as `LocalCheckpointManager` does: the restart
  lets the agents choose a replica or an older iteration.
- **Every step** (`overlap=True`, with `every_n_train_steps=1`): `StepSnapshot`'s way of saving
  (see `ftrun.checkpointing.snapshot`). A local save then holds the step only for building the
  dict; the copies run behind the next step, every optimizer's `step()` waits until they are
  done, and a save that finds the previous one still running is skipped (`skipped`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ftrun.checkpointing import (
    BasicTensorAwareStateDict,
    CheckpointNotFoundError,
    LocalCheckpointManager,
)
from ftrun.lightning import nvrx_io, state_codec
from ftrun.lightning._compat import CheckpointIO, TorchCheckpointIO
from ftrun.lightning.errors import LightningUsageError
from ftrun.lightning.local_callback import LocalCheckpointCallback
from ftrun.owned_dir import replace_file

log = logging.getLogger("ftrun.lightning")

NEWEST = "ftrun:newest"
"""The `ckpt_path` that `resume_path` returns: load the newest good copy."""
INDEX_FILE = ".ftrun-steps.json"
_STEP_IN_NAME = re.compile(r"step=(\d+)")


class HierarchicalCheckpointIO(CheckpointIO):
    """Local checkpoints every `every_n_train_steps` steps beside the global ones (see module).

    `local_ckpt_dir`: the local manager's root; `session_id`, `repl_strategy`,
    `persist_to_disk`: `LocalCheckpointManager`'s; `checkpoint_io`: the global IO;
    `async_save`: local saves return after the copy of the bytes (the write finishes behind);
    `overlap`: the copy too runs behind (every step's saves: see the module).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """ftrun's form `(local_ckpt_dir, every_n_train_steps, *, checkpoint_io=None,
        session_id="lightning", repl_strategy=None, persist_to_disk=True, async_save=True)`, or
        NVRx's `(wrapped_checkpoint_io, local_ckpt_manager, get_global_ckpt_iteration_fn,
        async_save=False)` (see `nvrx_io`), told apart by the first argument's type."""
        self.overlap, self.skipped = False, 0  # ftrun's form may set them
        if nvrx_io.is_nvrx_form(args, kwargs):
            nvrx_io.init_nvrx_form(self, *args, **kwargs)
        else:
            self._init_ftrun_form(*args, **kwargs)
        self.loaded_from: str | None = None
        """What `load_checkpoint(NEWEST)` loaded: "local:<step>" or the global file's path."""
        self._global_dirs: list[Path] = []

    def _init_ftrun_form(
        self,
        local_ckpt_dir: str | Path,
        every_n_train_steps: int,
        *,
        checkpoint_io: Any = None,
        session_id: str = "lightning",
        repl_strategy: Any = None,
        persist_to_disk: bool = True,
        async_save: bool = True,
        overlap: bool = False,
    ) -> None:
        if type(every_n_train_steps) is not int or every_n_train_steps < 1:
            raise LightningUsageError(
                f"every_n_train_steps must be an int >= 1, not {every_n_train_steps!r}"
            )
        self.every_n_train_steps: int | None = every_n_train_steps
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self.manager = LocalCheckpointManager(
            local_ckpt_dir, session_id, repl_strategy, persist_to_disk=persist_to_disk
        )
        self.async_save = async_save
        self.get_global_ckpt_iteration_fn: Any = None
        self.overlap = overlap
        if overlap:  # the saved tensors stay as they were until their copies are done
            self._fence = register_optimizer_step_pre_hook(lambda *_: self.manager.fence())

    @classmethod
    def get_partial_wrapper_constructor(
        cls, local_ckpt_manager: Any, get_global_ckpt_iteration_fn: Any
    ) -> Any:
        """NVRx's: the constructor with everything but the wrapped IO given."""
        return functools.partial(
            cls,
            local_ckpt_manager=local_ckpt_manager,
            get_global_ckpt_iteration_fn=get_global_ckpt_iteration_fn,
        )

    @property
    def local_ckpt_manager(self) -> LocalCheckpointManager:
        return self.manager  # NVRx's name

    def callback(self) -> LocalCheckpointCallback:
        """The callback that triggers the local saves; add it to the trainer's callbacks."""
        return LocalCheckpointCallback(self)

    # ---- local tier ------------------------------------------------------------------------

    def save_local(
        self, checkpoint: dict[str, Any], step: int, is_async: bool | None = None
    ) -> Any:
        """Save this rank's copy of `checkpoint` as local iteration `step` (through
        `to_tensor_aware_state_dict`); NVRx's `AsyncRequest` when async."""
        if self.skips_now():
            return None
        wrapped = self.to_tensor_aware_state_dict(checkpoint)
        if not isinstance(wrapped, BasicTensorAwareStateDict):
            raise LightningUsageError(
                f"to_tensor_aware_state_dict must return a BasicTensorAwareStateDict, not "
                f"{type(wrapped).__name__} (ftrun stores no pickled objects)"
            )
        storable = BasicTensorAwareStateDict(state_codec.encode(wrapped.state_dict))
        if self.overlap:
            return self.manager.save(storable, step, overlap=True)
        async_save = self.async_save if is_async is None else is_async
        return self.manager.save(storable, step, is_async=async_save)

    def skips_now(self) -> bool:
        """With `overlap`, whether a local save now would be skipped (and count it): the
        previous one is still running, and the training never waits for node memory. Asked
        before the checkpoint dict is built, so a skipped step does not build it."""
        if self.overlap and self.manager.saving:
            self.skipped += 1
            return True
        return False

    def to_tensor_aware_state_dict(self, checkpoint: dict[str, Any]) -> Any:
        """NVRx's hook (abstract there): the Lightning checkpoint, wrapped."""
        return BasicTensorAwareStateDict(checkpoint)

    def from_tensor_aware_state_dict(self, tensor_aware_checkpoint: Any, **kwargs: Any) -> Any:
        """NVRx's hook (abstract there): the Lightning checkpoint back."""
        return tensor_aware_checkpoint.state_dict

    # ---- global tier (Lightning's CheckpointIO) --------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> Any:
        local = nvrx_io.local_options(storage_options)
        if local is not None:  # NVRx's `trainer.save_checkpoint(None, storage_options=...)`
            if path is not None:
                raise LightningUsageError(f"a local checkpoint takes no path, got {path!r}")
            return self.save_local(checkpoint, local["iteration"], local.get("is_async"))
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        _note_step(Path(path), checkpoint.get("global_step"))
        return None

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        if self.get_global_ckpt_iteration_fn is not None and str(path) != NEWEST:
            return nvrx_io.load_newer(self, path, map_location, weights_only, **kwargs)
        if str(path) != NEWEST:
            return self._load_global(Path(path), map_location, weights_only)
        return self._load_newest(map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.checkpoint_io.remove_checkpoint(path)
        _note_step(Path(path), None)

    def teardown(self) -> None:
        self.manager.fence()
        self.manager.wait()  # an async local save in flight becomes complete (or raises)
        if self.overlap:
            self._fence.remove()
        self.checkpoint_io.teardown()

    # ---- resume ----------------------------------------------------------------------------

    def resume_path(self, *global_dirs: str | Path) -> str | None:
        """`NEWEST` if a local or global copy exists (in `global_dirs`), else None."""
        self._global_dirs = [Path(d) for d in global_dirs]
        if self.manager.find_latest() >= 0 or _global_candidates(self._global_dirs):
            return NEWEST
        return None

    def _load_newest(self, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        local = self.manager.find_latest()
        for step, path in _global_candidates(self._global_dirs):
            if local >= step:
                break
            if (loaded := self._try_global(path, map_location, weights_only)) is not None:
                return loaded
        if local >= 0 and (loaded := self._try_local()) is not None:
            return loaded
        for _step, path in _global_candidates(self._global_dirs):
            if (loaded := self._try_global(path, map_location, weights_only)) is not None:
                return loaded
        raise CheckpointNotFoundError(
            f"no loadable checkpoint: none local, none good in {list(map(str, self._global_dirs))}"
        )

    def _try_local(self, **kwargs: Any) -> dict[str, Any] | None:
        try:
            state, ckpt_id = self.manager.load()
        except CheckpointNotFoundError as exc:  # torchrun: every part of it was set aside
            log.warning("no local checkpoint after all: %s", exc)
            return None
        self.loaded_from = f"local:{ckpt_id.iteration}"
        log.info("resuming from the local checkpoint of step %d", ckpt_id.iteration)
        if isinstance(state, BasicTensorAwareStateDict):
            state = state.state_dict
        wrapped = BasicTensorAwareStateDict(state_codec.decode(state))
        return self.from_tensor_aware_state_dict(wrapped, **kwargs)

    def _try_global(
        self, path: Path, map_location: Any, weights_only: bool | None
    ) -> dict[str, Any] | None:
        try:
            loaded = self._load_global(path, map_location, weights_only)
        except Exception as exc:  # a torn or corrupt file: the next copy may be good
            log.warning("skipping checkpoint %s: %s: %s", path, type(exc).__name__, exc)
            return None
        log.info("resuming from %s (step %s)", path, loaded.get("global_step"))
        self.loaded_from = str(path)
        return loaded

    def _load_global(
        self, path: Path, map_location: Any, weights_only: bool | None
    ) -> dict[str, Any]:
        kwargs = {} if map_location is None else {"map_location": map_location}
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only, **kwargs)


def _global_candidates(dirs: list[Path]) -> list[tuple[int, Path]]:
    """(step, file) of every checkpoint file in `dirs`, newest step first. Steps come from the
    index this IO keeps, else from a `step=N` in the name; other files are not candidates."""
    found: dict[Path, int] = {}
    for directory in dirs:
        index = _read_index(directory)
        for path in directory.glob("*.ckpt"):
            real = path.resolve()
            step = index.get(real.name) if real.parent == directory.resolve() else None
            if step is None and (match := _STEP_IN_NAME.search(real.name)):
                step = int(match.group(1))
            if step is not None and real.is_file():
                found.setdefault(real, step)
    return sorted(((s, p) for p, s in found.items()), key=lambda sp: (-sp[0], str(sp[1])))


def _read_index(directory: Path) -> dict[str, int]:
    try:
        raw = json.loads((directory / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in raw.items() if type(v) is int} if isinstance(raw, dict) else {}


def _note_step(path: Path, step: Any) -> None:
    """Record (or with None forget) the step of checkpoint file `path` in its dir's index."""
    index = _read_index(path.parent)
    if step is None:
        if index.pop(path.name, None) is None:
            return
    elif type(step) is int:
        index[path.name] = step
    else:
        return
    try:
        replace_file(path.parent / INDEX_FILE, json.dumps(index))
    except OSError as exc:  # the index is a hint: a missing one only costs name parsing
        log.warning("could not update %s: %s", path.parent / INDEX_FILE, exc)
