"""Where this process sits in the tensor x pipeline grid, and the collectives the model needs.

Ranks are laid out stage-major: global rank = pp_rank * tp_size + tp_rank; rank 0 (stage 0, tp rank 0) is the
driver, the engine process itself. Process groups are built without torch.distributed's global state (a
TCPStore + one ProcessGroupGloo/NCCL object per group, as vLLM's stateless groups do), so one Python process may
start, shut down and start again engines with different sizes (the tests do).

Collectives:
  * tensor parallel: all-reduce after the row-parallel o_proj/down_proj and the vocab-parallel embedding, a gather
    of the vocab-parallel logits onto the stage's tp rank 0;
  * pipeline parallel: (hidden, residual) sent to the same tp rank of the next stage;
  * control (gloo on the CPU even with NCCL for activations): the driver's per-step broadcast and the logits sent
    back to it from the last stage.

Exposure: the rendezvous store is torch's TCPStore, which has no authentication and by default listens on every
interface. When the ranks meet on a loopback address (the `mp` backend: one machine), the store and gloo's
sockets are bound to that address, so nothing off the machine can reach them; and on the CPU, where no group needs
the store after it is built (NCCL would, for its lazily created communicators), the store is closed once every rank
has built its groups. Multi-node (`ray`) rendezvous stays on the node address for the group's start-up.
"""
from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedserve.core.kv_cache_manager import cdiv

# Sends and receives of one kind never interleave with another kind between the same pair of ranks within a
# step, but distinct tags keep a protocol bug from silently pairing the wrong messages.
TAG_HIDDEN, TAG_LOGITS = 1, 2


@dataclass(frozen=True)
class ParallelLayout:
    """The shape of the grid: which heads, vocabulary rows and layers a rank owns. Plain arithmetic, no groups."""
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp_size)

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads per rank: split when there are at least as many as ranks, else each rank holds (a replica of)
        the one its query heads use."""
        return max(1, num_kv_heads // self.tp_size)

    def kv_head_start(self, num_kv_heads: int, tp_rank: int) -> int:
        return tp_rank * num_kv_heads // self.tp_size

    def vocab_rows(self, vocab_size: int) -> int:
        """Vocabulary rows per rank (the last rank's tail is padding when tp does not divide the vocabulary)."""
        return cdiv(vocab_size, self.tp_size)

    def layer_range(self, num_layers: int, pp_rank: int) -> range:
        """Contiguous layers of a stage; the first stages take one more when pp does not divide them."""
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (pp_rank < extra))

    def validate(self, num_heads: int, num_kv_heads: int, intermediate_size: int, num_layers: int) -> None:
        """A clear ValueError for a model this grid cannot split, before any process starts."""
        tp, pp = self.tp_size, self.pp_size
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}.")
        if num_heads % tp:
            raise ValueError(f"The model's {num_heads} attention heads are not divisible by "
                             f"tensor_parallel_size={tp}.")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"The model's {num_kv_heads} KV heads can neither be split over nor replicated on "
                             f"tensor_parallel_size={tp} ranks (one must divide the other).")
        if intermediate_size % tp:
            raise ValueError(f"The model's intermediate_size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp}.")
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers.")


@dataclass
class ParallelState:
    """This rank's place in the grid and its process groups (None where a group would have one member)."""
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0
    world_group: dist.ProcessGroup | None = None  # control messages and pipeline sends (gloo)
    tp_group: dist.ProcessGroup | None = None  # activations (gloo on CPU, NCCL on CUDA)
    store: dist.Store | None = None  # kept alive with the groups

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp_size - 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def logits_rank(self) -> int:
        """The global rank that ends up with the full logits: tp rank 0 of the last stage."""
        return (self.layout.pp_size - 1) * self.layout.tp_size

    # ------------------------------------------------------------------ tensor parallel
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            self.tp_group.allreduce([x]).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[rows, vocab/tp] per rank -> [rows, vocab] on tp rank 0 (None elsewhere)."""
        if self.tp_group is None:
            return logits[:, :vocab_size]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        logits = logits.contiguous()
        if self.tp_rank != 0:
            self.tp_group.gather([], [logits], opts).wait()
            return None
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        self.tp_group.gather([parts], [logits], opts).wait()
        return torch.cat(parts, dim=1)[:, :vocab_size]

    # ------------------------------------------------------------------ pipeline parallel
    def send_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        # the world group is gloo: activations travel through host memory even on CUDA
        self.world_group.send([torch.stack((x, residual)).cpu()], self.rank + self.tp_size, TAG_HIDDEN).wait()

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype)
        self.world_group.recv([buf], self.rank - self.tp_size, TAG_HIDDEN).wait()
        buf = buf.to(device)
        return buf[0], buf[1]

    def send_logits_to_driver(self, logits: torch.Tensor) -> None:
        self.world_group.send([logits.float().cpu()], 0, TAG_LOGITS).wait()  # the driver's buffer is float32

    def recv_logits_from_last_stage(self, num_rows: int, vocab_size: int) -> tuple[dist.Work, torch.Tensor]:
        """Posts the receive and returns at once (the last stage can send while this rank works on another batch):
        the buffer holds the logits once the work's wait() returns."""
        buf = torch.empty((num_rows, vocab_size), dtype=torch.float32)
        return self.world_group.recv([buf], self.logits_rank, TAG_LOGITS), buf

    def shutdown(self) -> None:
        for group in (self.tp_group, self.world_group):
            if group is not None:
                group.shutdown()
        self.tp_group = self.world_group = self.store = None


SINGLE = ParallelState()  # one process: every collective is a no-op


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def create_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The driver's rendezvous store, on a free port (read back from `.port`). On a loopback host it listens there
    only: torch's server binds every interface unless handed a socket that is already bound."""
    listen_fd = None
    if is_loopback(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(world_size * 4)
        listen_fd = sock.detach()  # the store owns (and closes) it from here
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listen_fd)


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                bind_host: str | None) -> dist.ProcessGroupGloo:
    if bind_host is None:  # gloo's default: the address this machine's hostname resolves to
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def init_parallel_state(layout: ParallelLayout, rank: int, store: dist.Store, device: torch.device,
                        timeout_s: float, store_host: str | None = None) -> ParallelState:
    """Join the grid (blocks until every rank has): the world group, and this rank's stage's tp group. With the
    store on a loopback `store_host`, gloo binds there too and, on the CPU, the store is let go once every rank is
    in (the driver's copy is the server: dropping it closes the port)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    bind_host = store_host if store_host is not None and is_loopback(store_host) else None
    world_group = _gloo_group(dist.PrefixStore("world", store), rank, layout.world_size, timeout, bind_host)
    tp_group = None
    if layout.tp_size > 1:
        pp_rank, tp_rank = layout.coords(rank)
        tp_store = dist.PrefixStore(f"tp{pp_rank}", store)
        if device.type == "cuda":
            tp_group = dist.ProcessGroupNCCL(tp_store, tp_rank, layout.tp_size)
        else:
            tp_group = _gloo_group(tp_store, tp_rank, layout.tp_size, timeout, bind_host)
    if bind_host is not None and device.type != "cuda":
        world_group.barrier().wait()  # every rank has built all its groups: nobody needs the store any more
        store = None
    return ParallelState(layout, rank, world_group, tp_group, store)
