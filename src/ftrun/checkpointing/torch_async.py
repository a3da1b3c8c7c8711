"""`TorchAsyncCheckpoint`: NVRx's asynchronous `torch.save`, on ftrun's `AsyncCallsQueue`.

`async_save(state_dict, f)` copies every tensor to new host memory in the caller (a device-to-host
copy for CUDA tensors; CPU tensors are cloned too, so that the caller may go on changing them,
where NVRx hands the live CPU tensor to the writer), then `torch.save`s the copy in the queue's
background thread. `finalize_async_save` finalizes what has finished, or everything with
`blocking`. The file is a plain `torch.save` file: load it with `torch.load(...,
weights_only=True)`, never a file another user can write.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ftrun.checkpointing.async_calls import AsyncCallsQueue, AsyncRequest
from ftrun.checkpointing.state_dict import map_nested

logger = logging.getLogger("ftrun.checkpointing")


class TorchAsyncCheckpoint:
    """NVRx's `TorchAsyncCheckpoint(persistent_queue=True)`: `async_save`, `finalize_async_save`,
    `close`. `persistent_queue=False` runs each save in its own thread."""

    def __init__(self, persistent_queue: bool = True) -> None:
        self.save = torch.save
        self._async_calls_queue: AsyncCallsQueue | None = AsyncCallsQueue(
            persistent=persistent_queue
        )

    def async_save(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """`torch.save(state_dict, *args, **kwargs)` in the background, of a copy taken now."""
        if self._async_calls_queue is None:
            raise RuntimeError("TorchAsyncCheckpoint is closed")
        copied = host_copy(state_dict)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        request = AsyncRequest(torch.save, (copied, *args), [], kwargs)
        self._async_calls_queue.schedule_async_request(request)

    def finalize_async_save(
        self, blocking: bool = False, no_dist: bool = True, terminate: bool = False
    ) -> None:
        """Finalize the saves that finished (all of them with `blocking`); `no_dist=False`
        agrees with the other ranks (collective); `terminate` closes the queue after."""
        queue = self._async_calls_queue
        if queue is None:
            return
        if blocking and queue.get_num_unfinalized_calls() > 0:
            logger.info("finalizing the unfinished async torch.save calls")
        queue.maybe_finalize_async_calls(blocking, no_dist=no_dist)
        if terminate:
            self.close()

    def close(self, abort: bool = False) -> None:
        """Finish every save (or, with `abort`, drop them) and stop the background thread."""
        queue, self._async_calls_queue = self._async_calls_queue, None
        if queue is not None:
            queue.close(abort=abort)

    def _get_async_calls_queue(self) -> AsyncCallsQueue | None:
        return self._async_calls_queue  # NVRx's name, which its tests use

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as e:  # at interpreter exit: say it, never raise from __del__
            logger.warning("TorchAsyncCheckpoint: closing at exit failed: %s", e)


def host_copy(value: Any) -> Any:
    """`value` with every tensor copied to new host memory; dicts, lists and tuples rebuilt."""
    return map_nested(value, torch.Tensor, _to_host)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu", non_blocking=True)
