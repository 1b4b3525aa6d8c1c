"""One rank's point-to-point messages of a pipeline step (`runtime.pipeline.PipelineRunner`).

Sends are ``isend`` and receives block, so each rank runs its own schedule order. A pending send
keeps its tensor alive until it is waited, and gloo's ``Work.is_completed`` stays False until
``wait``; waiting on every send only at the end of the step would hold every micro-batch's sent
boundaries until then. So each send records which action of the receiving rank's order receives
it, and when a message from that rank arrives (sent by one of its actions, which ran after every
earlier action of its order and their receives), the sends those actions received are waited
(they return at once) and released. Messages between chunks of one rank (interleaved schedules)
are kept locally.

What PyTorch lacks: ``torch.distributed.pipelining`` tracks its own sends per stage, but its
stages allocate a receive buffer per micro-batch (`runtime.torch_pipeline`); ``P2POp`` /
``batch_isend_irecv`` have no notion of a peer's progress through its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from runtime.schedules import Action

__all__ = ["Mailbox"]


class Mailbox:
    """The messages of one step of rank `rank`: ``orders[g]`` is the action order of device
    group g (a chunk c runs on group ``c % len(orders)``)."""

    def __init__(self, rank: int, orders: Sequence[Sequence[Action]]) -> None:
        self.rank = rank
        self._position = [{a: i for i, a in enumerate(o)} for o in orders]
        # per peer rank: its sends not yet known received, with the index of the action of the
        # peer's order that receives each
        self._pending: dict[int, list[tuple[int, Any]]] = {}
        self._local: dict[int, torch.Tensor] = {}  # tag -> value sent to this rank

    def _at(self, action: Action) -> int:
        return self._position[action[1] % len(self._position)][action]

    def send(self, t: torch.Tensor, dst: int, tag: int, receiver: Action) -> None:
        """Send `t` to rank `dst` (kept locally when `dst` is this rank); `receiver`: the action
        of `dst`'s order that receives it."""
        if dst == self.rank:
            self._local[tag] = t
            return
        work = dist.isend(t, dst=dst, tag=tag)
        self._pending.setdefault(dst, []).append((self._at(receiver), work))

    def recv(
        self, buf: torch.Tensor, src: int, tag: int, sender: Action
    ) -> torch.Tensor:
        """Receive into `buf` from rank `src` (or take what this rank sent itself), sent by
        `src`'s action `sender`; then release the sends to `src` known received."""
        if src == self.rank:
            return self._local.pop(tag).clone()
        dist.recv(buf, src=src, tag=tag)
        at = self._at(sender)
        keep = []
        for i, work in self._pending.get(src, []):
            if i <= at:  # an action receives before it sends
                work.wait()
            else:
                keep.append((i, work))
        self._pending[src] = keep
        return buf

    def close(self) -> None:
        """Wait for every send left (the end of the step)."""
        for work in [w for p in self._pending.values() for _, w in p]:
            work.wait()
        self._pending, self._local = {}, {}
