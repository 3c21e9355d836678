"""Ranks that call parallelize with different settings or different weights get one named error
each, before any collective that could hang or mix their results."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fusedpar.testing.dist import run_distributed

CASES = {
    "same": ({}, {}),
    "threshold": ({"shift_threshold": 16}, {"shift_threshold": 64}),
    "block_size": ({"block_size": 16}, {"block_size": 8}),
    "weights": ({"seed": 0}, {"seed": 1}),
}


def _parallelize_worker(rank, world):
    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from tests.integrations.hf_models import make_model

    out = {}
    for name, per_rank in CASES.items():
        kw = dict(per_rank[rank])
        model = make_model("llama", seed=kw.pop("seed", 0))
        try:
            parallelize(model, ParallelLayout(world, sp=2), **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_ranks_that_disagree_are_named_on_every_rank():
    res = run_distributed(_parallelize_worker, 2, timeout=300)
    for rank, out in enumerate(res):
        assert out["same"] is None, f"rank {rank}: agreeing ranks were refused: {out['same']}"
        assert out["threshold"] and "shift_threshold: rank 0: 16; rank 1: 64" in out["threshold"], out["threshold"]
        assert out["block_size"] and "block_size: rank 0: 16; rank 1: 8" in out["block_size"], out["block_size"]
        assert out["weights"] and "embedding checksum" in out["weights"], out["weights"]
        for name in ("threshold", "block_size"):
            assert "embedding checksum" not in out[name], f"rank {rank}, {name}: names a setting that agrees"


# ---- per call: every forward / generate call checks that the ranks' inputs and settings agree ----
CALLS = {
    # name: (rank 0's call, rank 1's call); each a (kind, prompt seed, prompt length, batch, max_new_tokens)
    "same": (("forward", 0, 12, 2, 0), ("forward", 0, 12, 2, 0)),
    "tokens": (("forward", 0, 12, 2, 0), ("forward", 1, 12, 2, 0)),
    "length": (("forward", 0, 12, 2, 0), ("forward", 0, 9, 2, 0)),
    "batch": (("forward", 0, 12, 2, 0), ("forward", 0, 12, 3, 0)),
    "max_new_tokens": (("generate", 0, 6, 1, 3), ("generate", 0, 6, 1, 5)),
    # sampling with another seed per rank: the prompts agree, the decode calls' tokens do not
    "sampling": (("sample", 0, 6, 1, 6), ("sample", 0, 6, 1, 6)),
}


def _calls_worker(rank, world):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from tests.integrations.hf_models import make_model

    model = parallelize(make_model("llama", seed=0), ParallelLayout(world, sp=2), shift_threshold=4)
    out = {}
    for name, per_rank in CALLS.items():
        kind, seed, length, batch, new = per_rank[rank]
        ids = torch.randint(5, 200, (batch, length), generator=torch.Generator().manual_seed(seed))
        errors = []
        # generate with another max_new_tokens: one rank makes forward calls the other does not; its
        # next call (here a second generate) meets them and both raise instead of hanging
        for _ in range(2 if kind == "generate" else 1):
            try:
                if kind == "forward":
                    model(ids)
                elif kind == "sample":
                    torch.manual_seed(100 + rank)
                    model.generate(ids, max_new_tokens=new, do_sample=True, top_k=0, temperature=5.0)
                else:
                    model.generate(ids, max_new_tokens=new, do_sample=False)
            except ValueError as e:
                errors.append(str(e))
                break
        out[name] = errors[0] if errors else None
    # after the errors the ranks agree again: a matching call works
    ids = torch.randint(5, 200, (1, 7), generator=torch.Generator().manual_seed(3))
    out["after"] = model(ids).logits.shape[1]
    return out


def test_calls_that_disagree_raise_on_every_rank():
    res = run_distributed(_calls_worker, 2, timeout=300)
    for rank, out in enumerate(res):
        assert out["same"] is None, f"rank {rank}: agreeing calls were refused: {out['same']}"
        assert "input ids / embeddings (hash)" in out["tokens"] and "new columns" not in out["tokens"], out["tokens"]
        assert "new columns: rank 0: 12; rank 1: 9" in out["length"], out["length"]
        assert "batch: rank 0: 2; rank 1: 3" in out["batch"], out["batch"]
        assert out["max_new_tokens"] and "different calls" in out["max_new_tokens"], out["max_new_tokens"]
        assert out["sampling"] and "input ids / embeddings (hash)" in out["sampling"], out["sampling"]
        assert "new columns" not in out["sampling"], out["sampling"]
        assert out["after"] == 7


# ---- the check's timing: shapes at once, a decode call's contents LAG calls later or at flush ----
def _checker_worker(rank, world):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.integrations.hf.calls import LAG, CallChecker

    ctx = ParallelContext(ParallelLayout(world, tp=world), host_groups=True)
    checker = CallChecker(ctx.shift, ctx.host(ctx.shift), timeout=60)
    out = {"shared": checker.shapes.shared is not None}
    cpu = torch.device("cpu")

    def call(decode, token=7, batch=1):
        ids = torch.tensor([[token]]).expand(batch, 1)
        checker.check(batch=batch, new=1 if decode else 5, cached=4 if decode else -1, inputs=ids, attention_mask=None,
                      position_ids=None, use_cache=True, output_hidden_states=False, logits_to_keep=0,
                      decode=decode, device=cpu)

    def raised_at(calls):
        for i, fn in enumerate(calls):
            try:
                fn()
            except ValueError as e:
                return i, str(e)
        return None, None

    out["lag"] = LAG
    # a decode call whose tokens differ: found LAG calls later, on every rank
    out["decode"] = raised_at([lambda: call(False), lambda: call(True, token=7 + rank)]
                              + [lambda: call(True)] * (LAG + 1))
    # the same in a prefill-like call: found at once
    out["prefill"] = raised_at([lambda: call(False, token=7 + rank)])
    # shapes: found at once, in a decode call too
    out["shape"] = raised_at([lambda: call(True, batch=1 + rank)])
    # a pending decode call is compared by flush
    out["flush"] = raised_at([lambda: call(True, token=7 + rank), checker.flush])
    out["after"] = raised_at([lambda: call(False), lambda: call(True), checker.flush])
    return out


def test_call_checker_compares_shapes_at_once_and_decode_contents_later():
    for rank, out in enumerate(run_distributed(_checker_worker, 2, timeout=120)):
        lag = out["lag"]
        at, msg = out["decode"]
        assert at == 1 + lag, f"rank {rank}: decode mismatch raised at call {at}: {msg}"
        assert "input ids / embeddings (hash)" in msg and "rank 0:" in msg and "rank 1:" in msg, msg
        assert out["prefill"][0] == 0 and "input ids" in out["prefill"][1], out["prefill"]
        assert out["shape"][0] == 0 and "batch: rank 0: 1; rank 1: 2" in out["shape"][1], out["shape"]
        assert out["flush"][0] == 1 and "input ids" in out["flush"][1], out["flush"]
        assert out["after"] == (None, None), out["after"]
