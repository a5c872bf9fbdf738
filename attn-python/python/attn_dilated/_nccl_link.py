"""The NCCL communicator that a CUDA ring call's rows move over, one per (process group,
CUDA device): rank 0 of the group makes NCCL's unique id and broadcasts it over the group
(a uint8 tensor broadcast waited for against attn's timeout), every rank joins with it,
and later calls on the same group and device reuse the communicator. When rank 0 cannot
make an id, every rank raises with its reason (no rank waits for a communicator that
never forms)."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from . import _native
from ._transport import Transport

ID_BYTES = 128
# Broadcast frame: a status byte (0: an id follows, 1: rank 0's error text follows), a
# 4-byte little-endian length, then the id or the text.
_FRAME = 1024
_OK, _FAILED = 0, 1


def _encode(status: int, body: bytes) -> torch.Tensor:
    body = body[: _FRAME - 5]
    frame = bytes([status]) + len(body).to_bytes(4, "little") + body
    return torch.frombuffer(bytearray(frame.ljust(_FRAME, b"\0")), dtype=torch.uint8)


def _decode(frame: torch.Tensor) -> Tuple[int, bytes]:
    raw = bytes(frame.cpu().numpy())
    n = int.from_bytes(raw[1:5], "little")
    return raw[0], raw[5 : 5 + n]


class LinkCache:
    """Joined links by (group, device index). `make_id` and `join` are the native
    `nccl_unique_id` and `NcclLink` unless given (tests pass stand-ins)."""

    def __init__(self, make_id: Optional[Callable[[], bytes]] = None, join: Optional[Callable] = None):
        self._make_id = make_id or (lambda: bytes(_native.nccl_unique_id()))
        self._join = join or _native.NcclLink
        # The group object is kept with its link, so its id() is never reused while cached.
        self._links: Dict[Tuple[int, int], Tuple[object, object]] = {}

    def get(self, transport: Transport, device: torch.device, timeout: float):
        """The link of `transport`'s group on `device`, joined on first use (a collective
        of the group: every rank calls it for the same group and device)."""
        key = (id(transport.pg), device.index)
        hit = self._links.get(key)
        if hit is not None and hit[0] is transport.pg:
            return hit[1]
        uid = self.share_id(transport, timeout)
        link = self._join(transport.rank, transport.world, device.index, uid, timeout)
        self._links[key] = (transport.pg, link)
        return link

    def share_id(self, transport: Transport, timeout: float) -> bytes:
        """A unique id made on group rank 0 and broadcast to every rank of the group;
        RuntimeError on every rank where rank 0 could not make one."""
        frame = _encode(_OK, b"")
        if transport.rank == 0:
            try:
                uid = bytes(self._make_id())
                if len(uid) != ID_BYTES:
                    raise RuntimeError(f"an NCCL unique id of {len(uid)} bytes, not {ID_BYTES}")
                frame = _encode(_OK, uid)
            except Exception as e:  # every rank must hear of it, not only this one
                frame = _encode(_FAILED, f"{type(e).__name__}: {e}".encode())
        status, body = _decode(transport.broadcast(frame, timeout))
        if status != _OK:
            raise RuntimeError(f"rank 0 of the group could not make an NCCL unique id: {body.decode(errors='replace')}")
        if len(body) != ID_BYTES:
            raise RuntimeError(f"rank 0 of the group sent an NCCL unique id of {len(body)} bytes, not {ID_BYTES}")
        return body

    def __len__(self) -> int:
        return len(self._links)


LINKS = LinkCache()
