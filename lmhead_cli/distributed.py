"""Beyond one process: a file's batches shared among the ranks of `torchrun`, merged back in order.

Under `torchrun --nproc-per-node N` (one machine) or `torchrun --nnodes M --nproc-per-node N ...`
(several), every rank runs the same command. Each reads the whole file (lines are cheap; the model is
not), cuts it into the same batches, and computes only every N-th: rank r takes batches r, r + N,
r + 2N, ... Batch by batch, round by round, the ranks hand their readings to each other
(`all_gather_object`) and rank 0 writes them in the file's order, so the output is the one a single
process writes. Memory per rank: one round of batches, whatever the file's size.

gloo carries the readings between CPU processes, nccl between GPUs (each rank on the GPU its
LOCAL_RANK names). Without torchrun's environment (WORLD_SIZE unset or 1) nothing here starts and
the command runs as one process.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable, TypeVar

from lmhead_cli.errors import LmheadError, UsageError

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Ranks:
    """This process's place among torchrun's: rank 0 of 1 when run alone."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        """The ranks torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local = int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError:
            raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers (torchrun sets them)") from None
        if world > 1:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:  # torchrun sets all of them; without them init_process_group fails deep in torch
                verb = "is" if len(missing) == 1 else "are"
                raise UsageError(f"WORLD_SIZE is {world} but {' and '.join(missing)} {verb} not set: start lmhead "
                                 "under torchrun (torchrun --nproc-per-node N -m lmhead_cli ...), or unset WORLD_SIZE "
                                 "to run alone")
            if not 0 <= rank < world or not 0 <= local < world:
                raise UsageError(f"RANK {rank} and LOCAL_RANK {local} must lie in 0 to {world - 1} "
                                 f"(WORLD_SIZE {world})")
        return cls(rank, world, local) if world > 1 else cls()

    @property
    def writer(self) -> bool:
        """The rank that writes (rank 0)."""
        return self.rank == 0

    def start(self, device: str) -> str:
        """Join the process group (nccl for a GPU, gloo otherwise); the device this rank runs on."""
        if self.world == 1:
            return device
        import torch
        import torch.distributed as dist

        gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if gpu:
            torch.cuda.set_device(self.local_rank)
            device = f"cuda:{self.local_rank}"
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if gpu else "gloo")
        return device

    def share(self, items: Iterable[T], size: int) -> Iterator[T]:
        """This rank's items: of the groups of `size` consecutive items, every world-th from the rank-th.

        Every group but the last is full, so a consumer that cuts the result into groups of `size`
        gets exactly this rank's groups."""
        if self.world == 1:
            yield from items
            return
        items = iter(items)
        for n in itertools.count():
            group = list(itertools.islice(items, size))
            if not group:
                return
            if n % self.world == self.rank:
                yield from group

    def merge(self, batches: Iterator[list[T]]) -> Iterator[list[T]]:
        """This rank's batches (in order) -> on rank 0, every rank's batches in the file's order; the
        other ranks yield nothing. A domain error on any rank ends every rank with it."""
        if self.world == 1:
            yield from batches
            return
        import torch.distributed as dist

        while True:
            try:
                mine: object = next(batches, None)
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it, or they wait forever
                if os.environ.get("LMHEAD_DEBUG"):
                    raise
                mine = RankFailed(e.parts if isinstance(e, LmheadError) else (f"unexpected {type(e).__name__}: {e}",),
                                  getattr(e, "exit_code", 1), self.rank)
            round_: list = [None] * self.world
            dist.all_gather_object(round_, mine)
            for got in round_:
                if isinstance(got, RankFailed):
                    raise got
            if all(got is None for got in round_):
                return
            if self.writer:
                for got in round_:  # rank order is the file's order within a round
                    if got is not None:
                        yield got

    def spread(self, items: Iterable[T], size: int, work: Callable[[Iterator[T]], Iterator[R]]) -> Iterator[R]:
        """`work` (one result per item, in order) over this rank's share of `items` in groups of
        `size`; on rank 0, every rank's results in the items' order (share, then merge)."""
        results = work(self.share(items, size))
        yield from itertools.chain.from_iterable(self.merge(iter(lambda: list(itertools.islice(results, size)), [])))

    def gather(self, counts: T) -> list[T]:
        """Every rank's `counts`, in rank order, on every rank ([counts] alone)."""
        if self.world == 1:
            return [counts]
        import torch.distributed as dist

        every: list = [None] * self.world
        dist.all_gather_object(every, counts)
        return every

    def finish(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class RankFailed(LmheadError):
    """A rank's error, carried to every rank so that all of them stop with it (one line, its exit code)."""

    def __init__(self, parts: tuple, exit_code: int, rank: int):
        super().__init__(*parts, *([f" (on rank {rank})"] if rank else []))  # the parts keep their Params
        self.exit_code = exit_code
        self._given = (tuple(parts), exit_code, rank)

    def __reduce__(self):  # all_gather_object pickles it: rebuilt from its parts, so str() stays one line
        return (RankFailed, self._given)
