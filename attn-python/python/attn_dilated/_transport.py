"""The byte transport a ring call runs over: point-to-point rounds of uint8 tensors on a
torch.distributed process group (`batch_isend_irecv`; CPU tensors where the group's
backend is gloo, else tensors on the call's CUDA device, as NCCL needs), each waited for
against attn's own deadline, so a dead or silent rank is a `TimeoutError` (or the
backend's error) within the timeout rather than the backend's default wait. Collectives
of a CUDA call (gathering rows, broadcasting an NCCL unique id) are waited for the same way.

A round that fails leaves operations posted on the group that no later round can match,
so the group is marked broken for attn: every later ring call on it raises at once."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# Why a failed round left a process group (by `id`) with unmatched operations.
_BROKEN: Dict[int, str] = {}


class RoundTimeout(TimeoutError):
    """A round still incomplete at its deadline; `peer` is the group rank waited for."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


def _as_bytes(payload) -> torch.Tensor:
    """A uint8 CPU tensor over `payload` (a uint8 tensor or a bytes-like object)."""
    if isinstance(payload, torch.Tensor):
        return payload
    if len(payload) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8)


def frame_device(pg, device: Optional[torch.device]) -> torch.device:
    """Where a group's frames travel: the CPU where its backend is gloo (or includes it,
    as `cpu:gloo,cuda:nccl` does), else `device`, the call's CUDA device (NCCL carries
    CUDA tensors only)."""
    if device is None or device.type == "cpu" or "gloo" in str(dist.get_backend(pg)):
        return torch.device("cpu")
    return device


class Transport:
    """Rounds between the ranks of `group` (None: the default group), ranks numbered
    within the group; frames are uint8 tensors on `frame_device(group, device)`."""

    def __init__(self, group=None, device: Optional[torch.device] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
        self.pg = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.pg)
        self.world = dist.get_world_size(self.pg)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.device = frame_device(self.pg, device)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.pg, peer)

    def broken(self) -> Optional[str]:
        """Why this group can carry no more ring calls, or None."""
        return _BROKEN.get(id(self.pg))

    def _usable(self) -> None:
        """RuntimeError where an earlier failed round left this group out of step."""
        why = self.broken()
        if why is not None:
            raise RuntimeError(f"this process group failed an earlier ring round ({why}); create a new group")

    def mark_broken(self, why: str) -> None:
        """Refuse every later ring call on this group (a failed call left it out of step)."""
        _BROKEN[id(self.pg)] = why

    def exchange(self, sends: Sequence[Tuple[int, object]], recvs: Sequence[Tuple[int, int]], timeout: float):
        """Send each `(peer, payload)` and receive `length` bytes from each `(peer,
        length)` in one batch; the received uint8 tensors in `recvs` order. Raises
        `RoundTimeout` when the batch is incomplete after `timeout` seconds and
        RuntimeError when the backend fails a transfer; either marks the group broken."""
        self._usable()
        ops, waits = [], []
        for peer, payload in sends:
            frame = _as_bytes(payload).contiguous().to(self.device)
            ops.append(dist.P2POp(dist.isend, frame, self._global(peer), self.pg))
            waits.append(peer)
        bufs: List[torch.Tensor] = []
        for peer, length in recvs:
            buf = torch.empty(length, dtype=torch.uint8, device=self.device)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.pg))
            waits.append(peer)
        if not ops:
            return bufs
        self.run(lambda: dist.batch_isend_irecv(ops), waits, timeout)
        return bufs

    def run(self, start, peers: Sequence[int], timeout: float) -> None:
        """Start operations (`start()` returns their works, one per entry of `peers`, the
        group rank each waits for) and wait for them against `timeout`; a failure marks
        the group broken (`RoundTimeout` past the deadline, RuntimeError otherwise)."""
        self._usable()
        try:
            self._wait(start(), peers, timeout)
        except RoundTimeout as e:
            self.mark_broken(str(e))
            raise
        except Exception as e:
            self.mark_broken(f"{type(e).__name__}: {e}")
            raise RuntimeError(f"rank {self.rank}: a transfer failed: {e}") from e

    def _wait(self, works, peers: Sequence[int], timeout: float) -> None:
        """Wait for every work in turn, each against what is left of one deadline
        (`work.wait(timeout)`: gloo's sends and receives honour it). A wait that fails
        at or after the deadline is a `RoundTimeout`; any other failure re-raises."""
        deadline = time.monotonic() + timeout
        for work, peer in zip(works, peers):
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not work.wait(timeout=timedelta(seconds=left)):
                    raise RoundTimeout(f"rank {self.rank}: rank {peer} did not answer within {timeout} s", peer)
            except RoundTimeout:
                raise
            except Exception as e:
                if time.monotonic() >= deadline - 1e-3:
                    raise RoundTimeout(f"rank {self.rank}: rank {peer} did not answer within {timeout} s", peer) from e
                raise

    def group(self, sends, recvs, timeout: float) -> List[bytes]:
        """[`exchange`] with the received frames as `bytes`: the native ring's rounds."""
        return [bytes(b.cpu().numpy()) for b in self.exchange(sends, recvs, timeout)]

    def all_gather_rows(self, x: torch.Tensor, seq_dim: int, timeout: float) -> List[torch.Tensor]:
        """Every rank's `x` (same dtype and sizes except along `seq_dim`), by rank."""
        x = x.detach().contiguous()
        others = [p for p in range(self.world) if p != self.rank]
        mine = torch.tensor([x.shape[seq_dim]], dtype=torch.int64).view(torch.uint8)
        counts = self.exchange([(p, mine) for p in others], [(p, 8) for p in others], timeout)
        rows = {p: int(c.view(torch.int64)[0]) for p, c in zip(others, counts)}
        per_row = x.numel() // max(x.shape[seq_dim], 1) * x.element_size()
        payload = x.view(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
        got = self.exchange([(p, payload) for p in others], [(p, rows[p] * per_row) for p in others], timeout)
        out = []
        for p in range(self.world):
            if p == self.rank:
                out.append(x)
                continue
            shape = list(x.shape)
            shape[seq_dim] = rows[p]
            out.append(got[others.index(p)].view(x.dtype).view(shape))
        return out

    def broadcast(self, buf: torch.Tensor, timeout: float) -> torch.Tensor:
        """Group rank 0's `buf` (a uint8 tensor of the same size on every rank) on every
        rank, moved to the frame device and back to `buf`'s device."""
        t = buf.to(self.device).contiguous()
        root = self._global(0)
        self.run(lambda: [dist.broadcast(t, root, group=self.pg, async_op=True)], [0], timeout)
        return t.to(buf.device)

    def all_gather_device(self, x: torch.Tensor, seq_dim: int, timeout: float) -> List[torch.Tensor]:
        """Every rank's `x` by rank (same dtype and sizes except along `seq_dim`), gathered
        by the backend's all_gather on `x`'s own device (NCCL or gloo on CUDA tensors): the
        row counts first, then the rows padded to the largest count."""
        x = x.detach().contiguous()
        everyone = list(range(self.world))
        mine = torch.tensor([x.shape[seq_dim]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(mine) for _ in everyone]
        self.run(lambda: [dist.all_gather(counts, mine, group=self.pg, async_op=True)], [0], timeout)
        rows = [int(c.item()) for c in counts]
        most = max(rows)
        if most > x.shape[seq_dim]:
            pad = list(x.shape)
            pad[seq_dim] = most - x.shape[seq_dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=seq_dim)
        parts = [torch.empty_like(x) for _ in everyone]
        self.run(lambda: [dist.all_gather(parts, x, group=self.pg, async_op=True)], [0], timeout)
        return [p.narrow(seq_dim, 0, n) for p, n in zip(parts, rows)]
