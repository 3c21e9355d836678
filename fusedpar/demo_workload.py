"""What `fusedpar demo` runs on every rank: the model, the workload, the timings and the check.

Imported only by the demo (lazily) and by its spawned worker processes; it needs transformers
and fusedpar.integrations.hf. `run_ranks(rank, world, job)` runs every mode of `job` in one
process group (transformers is imported once per process, not once per mode):

- per mode: build the model (the built-in seeded random Llama config, or `load_parallel` of a
  local checkpoint), shard it with the mode's layout and shift threshold, warm up (the whole
  workload once, other prompts), then run the workload: for each phase one left-padded batch, a
  prefill forward without past_key_values (new sequences) and greedy decode steps with
  past_key_values, each step timed between barriers (forward + argmax, host-synchronised). Rank 0
  keeps every logit of every real position; every rank hashes its logits and tokens so the
  parent can check that all ranks agree.
- a re-sharding mode (Mode.decode set) is parallelized with both layouts declared and switches
  live with model.reshard: before each phase's prefill to its prefill layout (Mode.sp x Mode.tp,
  dp implied), and to its decode layout after `switch_after` decode steps (0: right after the
  prefill), moving the live sequences' KV; each switch is timed and its bytes recorded.
- after the last mode, rank 0 alone (its shards freed; the other ranks wait at a gloo barrier
  without holding a model) builds the unsharded model and runs one teacher-forced forward per
  request over the request's prompt and generated tokens. Its logits are the reference for every
  step of every mode; a sharded greedy token must be the reference's argmax unless the two
  candidates' reference logits are within the tolerance of each other (a near tie, which
  rounding may flip).
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fusedpar.layouts import ParallelLayout, StepMode

# The built-in model: Llama architecture, small enough for 4 CPU processes on 2 cores.
BUILTIN_CONFIG = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=4,
    head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
ALWAYS_SHIFT = 10**9  # a shift threshold no step reaches
FAULT_SCALE = 1.01  # --inject-fault: one rank's o_proj shard of layer 0 scaled by this


@dataclass(frozen=True)
class Phase:
    """One batch of requests: its prompts are prefilled together, then decoded together."""

    name: str
    prompt_lens: tuple[int, ...]
    new_tokens: int  # generated tokens per request (the first comes from the prefill step)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)


# Phase A: three long prompts (lengths not multiples of 2, 4 or 8: base mode pads them).
# Phase B: sixteen short requests, 5-20 tokens each, decoded for 24 tokens.
WORKLOAD = (
    Phase("long prompts", (237, 150, 93), 8),
    Phase("short requests", tuple(5 + (7 * i) % 16 for i in range(16)), 24),
)


@dataclass(frozen=True)
class Mode:
    """A layout (sp x tp, dp = W / (sp * tp)) and shift threshold; with `decode`, a second layout
    (sp, tp) that each phase switches to after `switch_after` decode steps."""

    label: str
    sp: int
    tp: int
    threshold: int
    optional: bool = False  # left out (not an error) when the model does not fit its layout
    decode: tuple[int, int] | None = None
    switch_after: int = 0

    def layouts(self, world: int) -> tuple[ParallelLayout, ...]:
        """The prefill layout, then the decode layout if the mode switches."""
        first = ParallelLayout(world, sp=self.sp, tp=self.tp)
        return (first,) if self.decode is None else (first, ParallelLayout(world, sp=self.decode[0],
                                                                           tp=self.decode[1]))


@dataclass(frozen=True)
class DemoJob:
    """Everything a worker needs (pickled to the spawned processes)."""

    modes: tuple[Mode, ...]
    device: str = "cpu"  # "cpu" (gloo, fp32) or "cuda" (one GPU per rank, NCCL groups, bf16)
    model_path: str | None = None  # None: the built-in config
    layers: int = 4
    seed: int = 0
    check: bool = True
    rtol: float = 1e-4
    fault: str | None = None  # test hook: label of the mode whose weights get a deliberate error
    workload: tuple[Phase, ...] = WORKLOAD

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def max_seq_len(self) -> int:
        return max(max(p.prompt_lens) + p.new_tokens for p in self.workload)


@dataclass
class ModeResult:
    """One mode on one rank. Timings are seconds; logits/tokens only kept on rank 0."""

    label: str
    prefill_s: list[float] = field(default_factory=list)  # per phase
    decode_s: list[list[float]] = field(default_factory=list)  # per phase, per decode step
    steps: dict[str, int] = field(default_factory=dict)  # timed steps per kind: "base", "shift", "dp" (step_kind)
    reshards: list[dict] = field(default_factory=list)  # model.reshard's results (seconds, bytes moved)
    digest: str = ""  # hash of this rank's logits (bitwise equality across ranks)
    token_digest: str = ""  # hash of this rank's greedy tokens
    tokens: list[list[int]] = field(default_factory=list)  # per request (prompt excluded), rank 0
    # filled by the reference check on rank 0
    checked: bool = False
    max_abs_err: float = float("nan")
    max_abs_logit: float = float("nan")
    token_mismatches: int = 0
    near_ties: int = 0


# ---- models ---------------------------------------------------------------------------------
def builtin_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **BUILTIN_CONFIG)


def randomize_(model, seed: int) -> None:
    """Seeded weights with O(1) activations and well-separated logits (HF's 0.02-std init gives
    near-ties in the argmax): linear N(0, 1/fan_in), embeddings N(0, 1), norms 1 + 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=gen)
            else:
                w = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            p.copy_(w.to(p.dtype))


def build_full_model(job: DemoJob, device: torch.device):
    """The unsharded model on `device` in the job's dtype (built-in: seeded; else from_pretrained)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if job.model_path is None:
        model = LlamaForCausalLM(builtin_config(job.layers))
        randomize_(model, job.seed)
        model = model.to(device=device, dtype=job.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=job.dtype, local_files_only=True)
        model = model.to(device)
    return model.eval()


def build_parallel_model(job: DemoJob, mode: Mode, world: int, device: torch.device):
    """A re-sharding mode parallelizes the full model with both layouts declared (a checkpoint is read
    whole on every rank then: load_parallel reads one layout's shards)."""
    from fusedpar.integrations.hf import load_parallel, parallelize

    layout, *others = mode.layouts(world)
    if job.model_path is None or others:
        return parallelize(build_full_model(job, device), layout, shift_threshold=mode.threshold,
                           max_seq_len=job.max_seq_len, reshard_layouts=others)
    return load_parallel(job.model_path, layout, dtype=job.dtype, device=device, shift_threshold=mode.threshold,
                         max_seq_len=job.max_seq_len, progress=False)


def inject_fault(model, rank: int, world: int) -> None:
    """Test hook: a sharding bug on one rank (its o_proj shard of layer 0 off by 1%)."""
    if rank == world - 1:
        with torch.no_grad():
            model.fusedpar_stack.layers[0].w.base["o"].mul_(FAULT_SCALE)


# ---- workload -------------------------------------------------------------------------------
def prompts(phase: Phase, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in phase.prompt_lens]


def left_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_kind(layout: ParallelLayout, mode: str) -> str:
    """What a step ran as: "base" (SP x TP within a replica), "shift" (TP over the whole replica) or, for a
    step a replica smaller than the world ran on its own rows, "dp": the stack counts that one as "shift"
    (TP over its replica, 1 rank at DP=W), but it is neither the base nor the shift layout of the world."""
    if mode == StepMode.BASE:
        return "base"
    return "dp" if layout.dp > 1 else "shift"


def steps_text(steps: dict[str, int]) -> str:
    """'2 base / 30 shift steps', with '/ n DP' when some steps ran data-parallel."""
    parts = [f"{steps.get('base', 0)} base", f"{steps.get('shift', 0)} shift"]
    if steps.get("dp", 0):
        parts.append(f"{steps['dp']} DP")
    return " / ".join(parts) + " steps"


def model_cache(out):
    """The KV cache a forward returned: `cache` where transformers names it so (there `past_key_values`
    is a deprecated alias), `past_key_values` in the versions before the rename."""
    return out.cache if "cache" in getattr(type(out), "__dataclass_fields__", {}) else out.past_key_values


def _timed(model, device: torch.device, steps: dict[str, int] | None = None, **kwargs):
    """One step between barriers: forward + greedy choice of the next tokens; (output, tokens, seconds).
    `steps` (when given) counts the step under its step_kind."""
    stack = model.fusedpar_stack  # the layout's stack this step runs on (a switch happens between steps)
    base_before = stack.steps[StepMode.BASE]
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    out = model(**kwargs)
    nxt = out.logits[:, -1].argmax(-1)
    nxt_cpu = nxt.cpu()  # the sampler's result on the host (synchronises)
    seconds = time.perf_counter() - t0
    if steps is not None:
        ran_base = stack.steps[StepMode.BASE] > base_before
        kind = step_kind(stack.ctx.layout, StepMode.BASE if ran_base else StepMode.SHIFT)
        steps[kind] = steps.get(kind, 0) + 1
    return out, nxt, nxt_cpu, seconds


def _reshard(model, layout: ParallelLayout, device: torch.device, log: list | None) -> None:
    """model.reshard between barriers; its result goes to `log` (None: a mode that never switches)."""
    if log is None or model.fusedpar_stack.ctx.layout == layout:
        return
    _sync(device)
    dist.barrier()
    res = model.reshard(layout)
    _sync(device)
    log.append({k: res[k] for k in ("seconds", "weight_bytes_moved", "kv_bytes_moved", "layout")})


def run_phase(model, phase: Phase, rows: list[list[int]], device: torch.device, keep: bool, hasher, tok_hasher,
              mode: Mode | None = None, reshards: list | None = None, steps: dict[str, int] | None = None):
    """Prefill + greedy decode of one batch. Returns (prefill s, [decode s], per-request logits, tokens).
    A re-sharding `mode` switches to its prefill layout first and to its decode layout after
    mode.switch_after decode steps, appending each switch's result to `reshards`. `steps` (when given)
    counts every step by its step_kind."""
    layouts = mode.layouts(dist.get_world_size()) if mode is not None else ()
    switching = len(layouts) > 1
    if switching:
        _reshard(model, layouts[0], device, reshards)
    ids, mask = left_padded(rows, device)
    lens = [len(r) for r in rows]
    out, nxt, nxt_cpu, t_prefill = _timed(model, device, steps, input_ids=ids, attention_mask=mask, use_cache=True)
    width = ids.shape[1]
    logits = [[out.logits[i, width - n:].float().cpu()] if keep else [] for i, n in enumerate(lens)]
    hasher.update(out.logits[mask.bool()].float().cpu().numpy().tobytes())
    tokens = [[t] for t in nxt_cpu.tolist()]
    past, decode_s = model_cache(out), []
    for k in range(phase.new_tokens - 1):
        if switching and k == mode.switch_after:
            _reshard(model, layouts[1], device, reshards)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out, nxt, nxt_cpu, t = _timed(model, device, steps, input_ids=nxt[:, None], attention_mask=mask,
                                      past_key_values=past, use_cache=True)
        decode_s.append(t)
        past = model_cache(out)
        step_logits = out.logits[:, -1].float().cpu()
        hasher.update(step_logits.numpy().tobytes())
        for i, t_i in enumerate(nxt_cpu.tolist()):
            tokens[i].append(t_i)
            if keep:
                logits[i].append(step_logits[i:i + 1])
    past.release()  # the requests are done: their KV is freed now, not carried through the next switch
    tok_hasher.update(repr(tokens).encode())
    return t_prefill, decode_s, [torch.cat(x) if x else None for x in logits], tokens


def run_mode(job: DemoJob, mode: Mode, rank: int, world: int, device: torch.device, vocab: int):
    """One mode on this rank: (ModeResult, per-request sharded logits on rank 0)."""
    model = build_parallel_model(job, mode, world, device)
    dist.monitored_barrier(timeout=timedelta(hours=1))  # ranks load at their own pace (big checkpoints)
    if job.fault is not None and job.fault == mode.label:
        inject_fault(model, rank, world)
    null = hashlib.sha256()
    # warm-up: the whole workload once with other prompts (kernels compiled for every shape,
    # allocator and paged cache grown), so the timed run measures steady-state steps
    for j, phase in enumerate(job.workload):
        run_phase(model, phase, prompts(phase, vocab, job.seed + 100 + j), device, False, null, null, mode, [])
    res = ModeResult(mode.label, steps={"base": 0, "shift": 0, "dp": 0})
    hasher, tok_hasher = hashlib.sha256(), hashlib.sha256()
    logits: list[torch.Tensor] = []
    for j, phase in enumerate(job.workload):
        t_prefill, decode_s, lg, toks = run_phase(model, phase, prompts(phase, vocab, job.seed + 1 + j), device,
                                                  rank == 0, hasher, tok_hasher, mode, res.reshards, res.steps)
        res.prefill_s.append(t_prefill)
        res.decode_s.append(decode_s)
        if rank == 0:
            logits += lg
            res.tokens += toks
    res.digest, res.token_digest = hasher.hexdigest(), tok_hasher.hexdigest()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res, logits


# ---- reference ------------------------------------------------------------------------------
def check_against_reference(job: DemoJob, results: list[ModeResult], logits: list[list[torch.Tensor]],
                            device: torch.device, vocab: int, log) -> None:
    """Rank 0: unsharded teacher-forced logits per request; fills the check fields of `results`."""
    model = build_full_model(job, device)
    all_prompts = [p for j, phase in enumerate(job.workload) for p in prompts(phase, vocab, job.seed + 1 + j)]
    cache: dict[tuple[int, ...], torch.Tensor] = {}  # token sequence -> reference logits (modes usually agree)
    with torch.no_grad():
        for res, mode_logits in zip(results, logits, strict=True):
            err, scale, refs = 0.0, 0.0, []
            for prompt, gen, got in zip(all_prompts, res.tokens, mode_logits, strict=True):
                seq = tuple(prompt + gen[:-1])  # the last generated token is never fed back
                if seq not in cache:
                    ids = torch.tensor([seq], dtype=torch.long, device=device)
                    cache[seq] = model(input_ids=ids, use_cache=False).logits[0].float().cpu()
                ref = cache[seq]
                # max() of Python floats drops a NaN (max(0.0, nan) is 0.0): a non-finite logit anywhere
                # (a prompt position decides no token, so the token check would not see it) fails as inf
                diff = (got - ref).abs().max().item() if torch.isfinite(got).all() else float("inf")
                err = max(err, diff)
                scale = max(scale, ref.abs().max().item())
                refs.append(ref)
            tol = job.rtol * scale
            mismatches = ties = 0
            for prompt, gen, ref in zip(all_prompts, res.tokens, refs, strict=True):
                rows = ref[len(prompt) - 1:]  # the logits that chose each generated token
                best = rows.argmax(-1)
                for k, tok in enumerate(gen):
                    if tok != best[k].item():
                        gap = (rows[k, best[k]] - rows[k, tok]).item()
                        if gap <= tol:
                            ties += 1
                        else:
                            mismatches += 1
            res.checked, res.max_abs_err, res.max_abs_logit = True, err, scale
            res.token_mismatches, res.near_ties = mismatches, ties
            log(f"  checked {res.label}: max |logit err| {err:.2e} (tolerance {tol:.2e}), "
                f"{mismatches} token mismatches")
    del model


# ---- the per-rank entry point ---------------------------------------------------------------
def run_ranks(rank: int, world: int, job: DemoJob) -> list[ModeResult]:
    """run_distributed body: every mode, then (rank 0) the reference check."""
    from fusedpar.testing.gpu import MULTICAST_OFF

    if job.device == "cuda":
        for k, v in MULTICAST_OFF.items():
            os.environ.setdefault(k, v)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device = torch.device("cpu")

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if job.model_path is None:
        vocab = BUILTIN_CONFIG["vocab_size"]
    else:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(job.model_path, local_files_only=True).vocab_size
    results, logits = [], []
    torch.manual_seed(job.seed)
    with torch.no_grad():
        for i, mode in enumerate(job.modes, 1):
            log(f"[{i}/{len(job.modes)}] {mode.label}: running")
            t0 = time.perf_counter()
            res, lg = run_mode(job, mode, rank, world, device, vocab)
            results.append(res)
            logits.append(lg)
            log(f"[{i}/{len(job.modes)}] {mode.label}: done in {time.perf_counter() - t0:.1f}s "
                f"({steps_text(res.steps)})")
    if rank == 0 and job.check:
        log("reference: the unsharded model on rank 0, one teacher-forced forward per request")
        check_against_reference(job, results, logits, device, vocab, log)
    # Everyone leaves together (after rank 0's reference, however long loading the full model
    # takes): no rank tears its process groups down while a peer still holds them.
    dist.monitored_barrier(timeout=timedelta(hours=2))
    if rank != 0:
        for r in results:
            r.tokens = []
    return results
