"""Peer-addressable workspaces for fused-collective kernels: real (torch symmetric memory) and emulated (CPU).

A fused-collective Triton kernel needs, per rank: this rank's index and the world size, a
table of the device addresses of every rank's data buffer (same layout on every rank), a table
of the addresses of every rank's flag words, and a little local state. `PeerTable` is exactly
that, and it is the only thing kernel launchers look at, so they take either backend:

    SymmetricWorkspace(group, nbytes)   torch symmetric memory on CUDA (one rank per process).
                                        Allocated and rendezvoused ONCE at construction: nothing
                                        on the hot path allocates, so CUDA-graph capture is safe.
    EmulatedWorld(world_size, nbytes)   every rank's buffers as CPU tensors in one process; the
                                        pointer tables hold their data_ptr()s, so a kernel run by
                                        the Triton interpreter (TRITON_INTERPRET=1) reads and
                                        writes "peer" memory exactly as on the GPU.

In a kernel: `tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.bfloat16))` is peer `peer`'s
data buffer; `tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int64))` its flag words.

Memory layout. Each rank's allocation is a zeroed prefix of `max_blocks * world_size` int64 flag
words, then the data buffer. Word [b * world_size + src] is written only by program b of rank
`src`, so flags of different GPUs never share a word; flags carry launch epochs and are never
reset. `counters` (local int64 words) hold EPOCH (completed launches), RETIRED (programs of the
current launch that finished) and STATUS (set to 1 by a bounded wait that gave up: a reported
error instead of a hang). The protocol every kernel on a PeerTable follows (epochs, release /
acquire, slot parity, requirements) is fusedpar.kernels._sync's docstring.

The flag words are our own prefix, not torch's signal pad: torch's barrier() uses that pad with
self-resetting 0/1 values that epoch words would corrupt, and growing it is a process-wide setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "ALIGN_BYTES",
    "COUNTER_EPOCH",
    "COUNTER_RETIRED",
    "COUNTER_STATUS",
    "NUM_COUNTERS",
    "EmulatedWorld",
    "PeerTable",
    "SymmetricWorkspace",
    "as_peer_table",
]

# Data buffers start on (and slot sizes are multiples of) 256 bytes: 16-byte vector loads need
# 16, and 256 keeps every typed view aligned for any dtype and for Triton's divisibility hints.
ALIGN_BYTES = 256

# Local int64 state words of a PeerTable (see the module docstring).
COUNTER_EPOCH = 0  # number of completed launches; a launch uses epoch counters[0] + 1
COUNTER_RETIRED = 1  # programs of the current launch that finished; the last one resets it
COUNTER_STATUS = 2  # 0 ok; 1 a bounded spin timed out (debug / interpreter only)
NUM_COUNTERS = 4  # one word spare for later protocols

DEFAULT_MAX_BLOCKS = 64


def _align(n: int, a: int = ALIGN_BYTES) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, eq=False)
class PeerTable:
    """What a fused-collective kernel needs from one rank: its index, peers' addresses, local state.

    rank, world_size: this rank's index in the group and the group size.
    buffer: this rank's data buffer, uint8 [buffer_bytes], on the kernel's device.
    buffer_ptrs: int64 [world_size] on the kernel's device: address of every rank's data buffer.
    signal_ptrs: int64 [world_size] on the kernel's device: address of every rank's flag words
        (int64 [max_blocks * world_size], word b * world_size + src written only by block b of src).
    counters: int64 [NUM_COUNTERS], local: EPOCH, RETIRED, STATUS (module docstring).
    max_blocks: most programs one launch may use (rows of flag words).
    owner: whatever owns the memory the address tables point at (the symmetric allocation and
        its handle, or the emulated world's tensors). Raw addresses keep nothing alive, so the
        table holds it: a table outliving its workspace must not point at freed memory.
    """

    rank: int
    world_size: int
    buffer: torch.Tensor
    buffer_ptrs: torch.Tensor
    signal_ptrs: torch.Tensor
    counters: torch.Tensor
    max_blocks: int
    owner: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"PeerTable: rank {self.rank} is outside [0, world_size={self.world_size})")
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 or not self.buffer.is_contiguous():
            raise ValueError("PeerTable: buffer must be a contiguous 1-D uint8 tensor")
        for name in ("buffer_ptrs", "signal_ptrs"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or tuple(t.shape) != (self.world_size,):
                raise ValueError(f"PeerTable: {name} must be int64 [{self.world_size}], got {t.dtype} {tuple(t.shape)}")
        if self.counters.dtype != torch.int64 or self.counters.numel() < NUM_COUNTERS:
            raise ValueError(f"PeerTable: counters must be int64 with >= {NUM_COUNTERS} words")
        devices = {t.device for t in (self.buffer, self.buffer_ptrs, self.signal_ptrs, self.counters)}
        if len(devices) != 1:
            raise ValueError(f"PeerTable: all tensors must be on one device, got {sorted(map(str, devices))}")
        if self.max_blocks < 1:
            raise ValueError(f"PeerTable: max_blocks must be >= 1, got {self.max_blocks}")

    @property
    def device(self) -> torch.device:
        """The device the kernels run on (where every tensor of the table lives)."""
        return self.buffer.device

    @property
    def buffer_bytes(self) -> int:
        """Size of each rank's data buffer in bytes (identical on every rank)."""
        return self.buffer.numel()

    @property
    def flag_words(self) -> int:
        """int64 flag words each rank owns: max_blocks * world_size."""
        return self.max_blocks * self.world_size

    def view(self, dtype: torch.dtype, numel: int | None = None, byte_offset: int = 0) -> torch.Tensor:
        """This rank's data buffer as a 1-D `dtype` tensor of `numel` elements from `byte_offset`."""
        esize = torch.empty((), dtype=dtype).element_size()
        if byte_offset % esize:
            raise ValueError(f"view: byte_offset {byte_offset} is not a multiple of {dtype} size {esize}")
        if numel is None:
            numel = max(0, self.buffer_bytes - byte_offset) // esize
        if numel < 0:  # a negative count would slice from the buffer's end
            raise ValueError(f"view: numel {numel} must be >= 0")
        end = byte_offset + numel * esize
        if byte_offset < 0 or end > self.buffer_bytes or byte_offset > self.buffer_bytes:
            raise ValueError(f"view: bytes [{byte_offset}, {end}) do not fit the {self.buffer_bytes}-byte buffer")
        return self.buffer[byte_offset:end].view(dtype)

    def epoch(self) -> int:
        """Launches completed on this table (host sync: tests and debugging only)."""
        return int(self.counters[COUNTER_EPOCH].item())

    def status(self) -> int:
        """STATUS counter: 0 ok, 1 a bounded spin timed out (host sync: tests and debugging only)."""
        return int(self.counters[COUNTER_STATUS].item())


def as_peer_table(obj: PeerTable | SymmetricWorkspace) -> PeerTable:
    """The PeerTable of `obj`: a PeerTable itself, or anything with a `.table` PeerTable attribute."""
    if isinstance(obj, PeerTable):
        return obj
    table = getattr(obj, "table", None)
    if isinstance(table, PeerTable):
        return table
    raise TypeError(f"expected a PeerTable or an object with a .table PeerTable (SymmetricWorkspace), got {type(obj)}")


class SymmetricWorkspace:
    """Torch symmetric memory for one process group: flag words + an `nbytes` data buffer per rank.

    Collective: every rank of `group` constructs it with the same arguments, in the same order
    relative to other collectives. Allocation, rendezvous and zeroing happen here, once; the
    kernels then only read the tables, so they can run inside CUDA-graph capture.
    The address tables are our own int64 device tensors rather than torch's buffer_ptrs_dev /
    signal_pad_ptrs_dev: ours point past the flag words at the data, and at our flag words
    instead of torch's signal pad (module docstring); `handle` keeps torch's for its barrier.

    group: a ProcessGroup, a group name (resolved with torch's registry), or a CommGroup of a
        ParallelContext (its .pg, with its .ranks checked).
    nbytes: data bytes per rank (rounded up to ALIGN_BYTES).
    ranks: optional global ranks of the group, checked against the group (a cheap guard against
        passing the wrong group of a ParallelContext).
    max_blocks: most programs a kernel launch may use (one row of flag words each).
    device: CUDA device; default the current one.
    """

    def __init__(
        self,
        group,
        nbytes: int,
        *,
        ranks: Sequence[int] | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        device: torch.device | str | int | None = None,
    ):
        # Lazy imports: CPU-only torch builds may lack (or fail to import) the symmetric-memory
        # extension, and importing fusedpar.collectives must stay side-effect free.
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if nbytes <= 0:
            raise ValueError(f"SymmetricWorkspace: nbytes must be positive, got {nbytes}")
        if max_blocks < 1:
            raise ValueError(f"SymmetricWorkspace: max_blocks must be >= 1, got {max_blocks}")
        if not dist.is_initialized():
            raise RuntimeError("SymmetricWorkspace needs torch.distributed initialised first")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("SymmetricWorkspace allocates and rendezvouses: build it before CUDA-graph capture")
        if hasattr(group, "pg") and hasattr(group, "ranks"):  # a ParallelContext CommGroup
            ranks = group.ranks if ranks is None else ranks
            group = group.pg
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        if group is None:
            raise ValueError("SymmetricWorkspace needs a process group (a size-1 group never communicates)")
        group_ranks = dist.get_process_group_ranks(group)
        if ranks is not None and list(ranks) != list(group_ranks):
            raise ValueError(f"SymmetricWorkspace: ranks {list(ranks)} do not match the group's {group_ranks}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"SymmetricWorkspace needs a CUDA device, got {device} (use EmulatedWorld on CPU)")

        self.group = group
        self.ranks: tuple[int, ...] = tuple(group_ranks)
        # (caller's group object, its process group or None): an eager router's answer for the
        # group it was last called with, so host-bound calls skip the lookups (gemm_all_reduce).
        self.eager_route: tuple | None = None
        world_size = group.size()
        self.flag_bytes = _align(max_blocks * world_size * 8)
        data_bytes = _align(nbytes)
        # One allocation per rank: [flag words | data]. Flag words sit in front so the data
        # buffer's offset (flag_bytes) is the same on every rank and ALIGN_BYTES-aligned.
        self._raw = symm_mem.empty(self.flag_bytes + data_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self._raw, group)
        if self.handle.world_size != world_size or self.handle.rank != group.rank():
            raise RuntimeError(
                f"symmetric-memory rendezvous disagrees with the group: rank {self.handle.rank}/"
                f"{self.handle.world_size} vs {group.rank()}/{world_size}"
            )
        # Epoch flags must start below every epoch (0 < 1); the data is zeroed too so a protocol
        # bug reads zeros on every rank alike instead of garbage that differs run to run.
        self._raw.zero_()
        counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=device)
        bases = [int(p) for p in self.handle.buffer_ptrs]
        self._peer_addresses = [b + self.flag_bytes for b in bases]
        buffer_ptrs = torch.tensor([b + self.flag_bytes for b in bases], dtype=torch.int64, device=device)
        signal_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        # Every peer's zeroing must have landed before any kernel of ours can set a flag there:
        # finish local work, then a stream-ordered device barrier across the group, then wait.
        torch.cuda.synchronize(device)
        self.handle.barrier(channel=0)
        torch.cuda.synchronize(device)
        from fusedpar.collectives.context import world_timeout

        self.timeout_ms = int(world_timeout().total_seconds() * 1000)  # barrier()'s bound on a missing peer

        buffer = self._raw[self.flag_bytes : self.flag_bytes + data_bytes]
        self.table = PeerTable(
            rank=self.handle.rank,
            world_size=world_size,
            buffer=buffer,
            buffer_ptrs=buffer_ptrs,
            signal_ptrs=signal_ptrs,
            counters=counters,
            max_blocks=max_blocks,
            owner=(self._raw, self.handle),
        )

    # The PeerTable attributes, forwarded so a workspace reads like its table.
    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.table.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self.table.world_size

    @property
    def buffer_ptrs(self) -> torch.Tensor:
        """int64 [world_size] device tensor: every rank's data buffer address."""
        return self.table.buffer_ptrs

    @property
    def signal_ptrs(self) -> torch.Tensor:
        """int64 [world_size] device tensor: every rank's flag-word address."""
        return self.table.signal_ptrs

    @property
    def buffer_bytes(self) -> int:
        """Data bytes per rank."""
        return self.table.buffer_bytes

    @property
    def device(self) -> torch.device:
        """The CUDA device of this rank's buffers."""
        return self.table.device

    def view(self, dtype: torch.dtype, numel: int | None = None, byte_offset: int = 0) -> torch.Tensor:
        """This rank's data buffer as a typed 1-D tensor (see PeerTable.view)."""
        return self.table.view(dtype, numel, byte_offset)

    def barrier(self, timeout_ms: int | None = None) -> None:
        """Device barrier across the group on the current stream (torch's signal pad, channel 0).

        Stream-ordered, not a host barrier: work queued after it on this stream starts only when
        every rank's stream reached it. Our kernels do not use torch's pad, so it never races
        with their epoch flags. A rank whose peers do not arrive within timeout_ms (default: the
        world process group's timeout; 0: forever) traps, a CUDA error that ends the process,
        instead of hanging.
        """
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms if timeout_ms is None else timeout_ms)

    def peer_addresses(self) -> list[int]:
        """Every rank's data buffer address (host ints, group order): what a kernel storing to peers needs."""
        return list(self._peer_addresses)

    def __repr__(self) -> str:
        return (
            f"SymmetricWorkspace(rank={self.rank}, world_size={self.world_size}, ranks={list(self.ranks)}, "
            f"buffer_bytes={self.buffer_bytes}, max_blocks={self.table.max_blocks}, device={self.device})"
        )


class EmulatedWorld:
    """Every rank's buffers in one process on CPU: the stand-in for SymmetricWorkspace in tests.

    world[r] (or world.tables[r]) is rank r's PeerTable. Each pointer table is a CPU int64 tensor
    of the data_ptr()s of every rank's buffer, so an interpreted Triton kernel (TRITON_INTERPRET=1)
    launched "as rank r" reads and writes the other ranks' buffers through it.

    Interpreted programs run one at a time, so a protocol in which rank r waits for rank q must be
    driven phase by phase (every rank's producing phase before any rank's consuming phase); the
    kernels split their phases with constexpr switches for that.

    Data buffers start poisoned with 0xFF bytes (NaN in fp16, bf16 and fp32) so a kernel that
    reads a slot nobody wrote produces NaNs instead of plausible numbers.
    """

    def __init__(self, world_size: int, nbytes: int, *, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if world_size < 1:
            raise ValueError(f"EmulatedWorld: world_size must be >= 1, got {world_size}")
        if nbytes <= 0:
            raise ValueError(f"EmulatedWorld: nbytes must be positive, got {nbytes}")
        self.world_size = world_size
        data_bytes = _align(nbytes)
        # The tables below hold raw addresses of these tensors: this object keeps them alive.
        self.buffers = [torch.full((data_bytes,), 0xFF, dtype=torch.uint8) for _ in range(world_size)]
        self.signals = [torch.zeros(max_blocks * world_size, dtype=torch.int64) for _ in range(world_size)]
        for b in self.buffers:
            if b.data_ptr() % 16:
                raise RuntimeError("EmulatedWorld: CPU allocation is not 16-byte aligned")
        buffer_addrs = [b.data_ptr() for b in self.buffers]
        signal_addrs = [s.data_ptr() for s in self.signals]
        self.tables = [
            PeerTable(
                rank=r,
                world_size=world_size,
                buffer=self.buffers[r],
                # One table tensor per rank, as on the GPU where each rank has its own copy.
                buffer_ptrs=torch.tensor(buffer_addrs, dtype=torch.int64),
                signal_ptrs=torch.tensor(signal_addrs, dtype=torch.int64),
                counters=torch.zeros(NUM_COUNTERS, dtype=torch.int64),
                max_blocks=max_blocks,
                owner=(self.buffers, self.signals),
            )
            for r in range(world_size)
        ]

    def __getitem__(self, rank: int) -> PeerTable:
        return self.tables[rank]

    def __len__(self) -> int:
        return self.world_size

    def barrier(self) -> None:
        """No-op: one process runs every emulated rank in program order."""

    def __repr__(self) -> str:
        return f"EmulatedWorld(world_size={self.world_size}, buffer_bytes={self.tables[0].buffer_bytes})"
