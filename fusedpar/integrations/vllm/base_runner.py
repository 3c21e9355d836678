"""The decoder model's forward in a base-mode step: scatter, layers, final norm, gather.

During a base step the decoder model's `forward` is this runner's (vLLM calls `self.forward`
when a step skips its compiled graph):

    hidden [n, d] = embedding          (or the step's inputs_embeds)
    local [m, d]  = this SP rank's rows of hidden zero-padded to n_pad = SP * m rows
    local         = final_norm(layers(local))   with the linear layers on their base path
    out [n, d]    = all-gather of every SP rank's m rows, padding dropped

The layers run one of two ways, the same on every rank:
  eager   vLLM's decoder modules, called from Python (CPU, enforce_eager, fp32 / PlainComm).
  graphs  `BaseGraphs`: per row bucket m, CUDA graphs of the stretches between attention calls,
          replayed; only vLLM's attention runs eagerly between them (its metadata, the KV cache
          write and the varlen kernel change every step). Host cost per layer: one replay, one
          attention call and one copy, instead of ~15 module calls and kernel launches.

Row buckets: with graphs a base step pads to the next bucket (multiples of BUCKET_ROWS rows per
rank, capped at the largest base step), so that a few graph sets serve every step. The padding
rows never reach attention (it takes the first n rows) and their outputs are dropped; every
other op is row-wise, so they cannot touch real rows.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from fusedpar.collectives import all_gather_rows

from .step import Step

logger = logging.getLogger("vllm.fusedpar")

BUCKET_ROWS = 64  # rows per rank between graph buckets: whole 64-row GEMM tiles, <= 7% padding at 896+ rows


def row_buckets(min_rows: int, max_rows: int, step: int = BUCKET_ROWS) -> tuple[int, ...]:
    """Bucket sizes covering every row count in [min_rows, max_rows]: multiples of `step`, the
    largest capped at max_rows."""
    if not 1 <= min_rows <= max_rows or step < 1:
        raise ValueError(f"row_buckets needs 1 <= min_rows <= max_rows and step >= 1, got min_rows={min_rows}, "
                         f"max_rows={max_rows}, step={step}")
    return tuple(sorted({min(-(-m // step) * step, max_rows) for m in range(min_rows, max_rows + 1)}))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= rows."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"a base step of {rows} rows per rank exceeds the largest bucket {buckets[-1]}")


class BaseRunner:
    """The base-step forward of one decoder model (see the module docstring).

    worker: the state.WorkerState whose current step (step.Step) the forward runs; inner: the
    decoder model; layers / norm: its decoder layers and final norm; attns: each layer's vLLM
    Attention module; kernels: the base_step.BaseKernels a base step switches vLLM's custom ops to.
    """

    def __init__(self, worker, inner: torch.nn.Module, layers, norm: torch.nn.Module, attns: list, kernels):
        self.worker, self.inner, self.layers, self.norm, self.attns = worker, inner, list(layers), norm, attns
        self.kernels = kernels
        self.graphs: BaseGraphs | None = None
        self.ran = False  # set by forward: the step really ran the base path

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.inner, "embed_input_ids", None) or self.inner.get_input_embeddings()
        return embed(input_ids)

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        step, worker = self.worker.step, self.worker
        if intermediate_tensors is not None:
            raise RuntimeError("fusedpar: base steps take no intermediate tensors (pipeline parallel is not supported)")
        hidden = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        n = hidden.shape[0]
        if n != step.num_tokens:
            raise RuntimeError(f"fusedpar: the decoder model got {n} rows, the step has {step.num_tokens} tokens")
        m, s = step.local_rows, worker.deployment.coords.sp
        if step.padded_tokens != n:
            hidden = F.pad(hidden, (0, 0, 0, step.padded_tokens - n))  # zero rows: never reach attention
        local = hidden[s * m:(s + 1) * m]
        if self.graphs is not None and not kwargs and self.graphs.serves(m):
            out = self.graphs.run(local, positions, n)
        else:
            out = self.run_layers(local, positions, **kwargs)
        self.ran = True
        return all_gather_rows(out.contiguous(), worker.comms.ctx.sp)[:n]

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, **kwargs)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class BaseGraphs:
    """CUDA graphs of the base steps of one decoder model, one set per row bucket.

    A set for bucket m (N = SP * m tokens) is L + 1 graphs: graph 0 runs from the static input
    rows through layer 0 up to its attention call, graph i from layer i-1's attention output to
    layer i's attention call, graph L from the last attention output through the final norm. At an
    attention call a graph copies q, k, v into static buffers [N, width]; replay runs vLLM's
    attention on their first n rows (the step's tokens) and copies its output into the static
    buffer [N, q width] that the next graph reads. Static buffers are sized for the largest bucket
    and shared by all sets (one step runs at a time). The graphs allocate from `pool`: vLLM's global
    graph pool, so that base and shift graphs (never replayed at the same time, no tensor of one live
    across the other's replay) reuse one another's memory instead of each holding its own.

    Capture is collective in effect: every rank captures the same buckets in the same order (largest
    first, so that every later set fits in the blocks the first one left in the pool), after
    one eager pass per bucket (Triton compiles, cuBLAS picks its kernels, the fused kernels' flags
    advance together on every rank).
    """

    def __init__(self, runner: BaseRunner, buckets: tuple[int, ...], *, hidden_size: int, q_width: int,
                 kv_width: int, dtype: torch.dtype, device: torch.device, pool=None):
        self.runner, self.buckets, self.sp = runner, buckets, runner.worker.deployment.layout.sp
        m_max = buckets[-1]
        n_max = m_max * self.sp

        def buf(rows: int, cols: int, dt=dtype) -> torch.Tensor:
            return torch.zeros(rows, cols, dtype=dt, device=device)

        self.hidden = buf(m_max, hidden_size)  # graph 0's input rows
        self.out = buf(m_max, hidden_size)  # graph L's output rows
        self.positions = torch.zeros(n_max, dtype=torch.long, device=device)
        self.q, self.k, self.v = buf(n_max, q_width), buf(n_max, kv_width), buf(n_max, kv_width)
        self.attn_out = buf(n_max, q_width)
        self.sets: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.stream = torch.cuda.Stream(device=device)

    def serves(self, rows: int) -> bool:
        return rows in self.sets

    def capture_all(self) -> float:
        """Warm up and capture every bucket; returns the seconds it took."""
        t0 = time.perf_counter()
        for m in reversed(self.buckets):  # largest first: the smaller sets reuse its pool blocks
            self._capture(m)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _capture(self, m: int) -> None:
        runner = self.runner
        n = m * self.sp
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        # the layers see a full bucket: no slicing, no padding
        with runner.worker.running(Step.base(n, m, self.sp)):
            runner.kernels.begin()
            try:
                with torch.cuda.stream(stream):
                    graphs = self._capture_set(m, n)
            finally:
                runner.kernels.end()
        torch.cuda.current_stream().wait_stream(stream)
        if len(graphs) != len(runner.attns) + 1:
            raise RuntimeError(f"fusedpar: captured {len(graphs)} graphs for {len(runner.attns)} attention layers")
        self.sets[m] = graphs

    def _capture_set(self, m: int, n: int) -> list[torch.cuda.CUDAGraph]:
        """An eager pass, then the graphs of bucket m (n tokens), split at every attention call."""
        runner = self.runner
        with _attention_calls(runner.attns, lambda q, k, v: self._stage(n, q, k, v)):
            runner.run_layers(self.hidden[:m], self.positions[:n])  # eager warm-up pass
        graphs: list[torch.cuda.CUDAGraph] = []
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        try:
            def split(q, k, v):
                nonlocal graph
                out = self._stage(n, q, k, v)
                graph.capture_end()
                graphs.append(graph)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                return out

            with _attention_calls(runner.attns, split):
                self.out[:m].copy_(runner.run_layers(self.hidden[:m], self.positions[:n]))
        finally:
            graph.capture_end()
        graphs.append(graph)
        return graphs

    def _stage(self, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for dst, src in ((self.q, q), (self.k, k), (self.v, v)):
            if src.numel() != n * dst.shape[1]:
                raise RuntimeError(f"fusedpar: attention input of {tuple(src.shape)} for {n} tokens, "
                                   f"expected {n} x {dst.shape[1]}")
            dst[:n].copy_(src.reshape(n, -1))
        return self.attn_out[:n]

    def run(self, local: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """One base step on bucket m = local rows: local [m, d], positions [n] -> this rank's [m, d]."""
        m = local.shape[0]
        graphs = self.sets[m]
        self.hidden[:m].copy_(local)
        self.positions[:n].copy_(positions)
        self.positions[n:m * self.sp].zero_()
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]
        for graph, attn in zip(graphs[:-1], self.runner.attns, strict=True):
            graph.replay()
            out.copy_(attn(q, k, v))
        graphs[-1].replay()
        return self.out[:m]


class _attention_calls:
    """Context: every attention module's call goes to fn(q, k, v) (instance-level forward)."""

    def __init__(self, attns: list, fn):
        self.attns, self.fn = attns, fn

    def __enter__(self):
        def forward(query, key, value, *args, **kwargs):
            if args or kwargs:
                raise RuntimeError(f"fusedpar: base-step graphs take attention(q, k, v) only, got extra "
                                   f"{len(args)} args and {sorted(kwargs)}")
            return self.fn(query, key, value)

        for attn in self.attns:
            attn.forward = forward
        return self

    def __exit__(self, *exc):
        for attn in self.attns:
            del attn.forward
        return False
