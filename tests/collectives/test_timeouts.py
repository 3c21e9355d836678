"""Every group ParallelContext creates carries one timeout: a stalled peer is an error within it."""

import datetime
import time

import torch

from fusedpar import ParallelLayout
from fusedpar.collectives import ParallelContext, all_reduce_sum
from fusedpar.testing.dist import run_distributed

STALL_S = 12.0


def _stall_worker(rank, world, timeout_s):
    ctx = ParallelContext(ParallelLayout(world, sp=1, tp=world), timeout=timeout_s)
    default = ParallelContext(ParallelLayout(world, sp=1, tp=world))
    if rank == 1:
        time.sleep(STALL_S)  # never joins the all-reduce below
        return {"timeout": ctx.timeout, "default": default.timeout}
    start = time.monotonic()
    try:
        all_reduce_sum(torch.ones(4), ctx.shift)
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"timeout": ctx.timeout, "default": default.timeout, "elapsed": time.monotonic() - start, "error": error}


def test_a_stalled_peer_fails_the_collective_within_the_context_timeout():
    res = run_distributed(_stall_worker, 2, 3.0, timeout=120, fresh=True)
    assert res[0]["timeout"] == datetime.timedelta(seconds=3)
    # run_distributed creates the world group with a 120 s timeout: the default follows it
    assert res[0]["default"] == res[1]["default"] == datetime.timedelta(seconds=120)
    assert res[0]["error"] is not None, "the all-reduce with a stalled peer returned"
    assert res[0]["elapsed"] < 3.0 + 6.0, f"the error took {res[0]['elapsed']:.1f} s with a 3 s timeout"


BAD_TIMEOUTS = (0, -1.0, "10", True)


def _bad_timeout_worker(rank, world):
    messages = []
    for value in BAD_TIMEOUTS:
        try:
            ParallelContext(ParallelLayout(world), timeout=value)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_timeout_must_be_positive_seconds_or_timedelta():
    (messages,) = run_distributed(_bad_timeout_worker, 1, timeout=120)
    for value, msg in zip(BAD_TIMEOUTS, messages, strict=True):
        assert msg is not None, f"timeout={value!r} was accepted"
        assert "timeout" in msg and repr(value) in msg, msg


EXIT_TIMEOUT_S = 8.0


def _exit_worker(rank, world, init_file, out_dir):
    """SP=2 x TP=2 HF generate; rank 3 dies after its second forward call. The survivors stay alive after
    their error (as a server would) and record when it came."""
    import datetime as dt
    import json
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=EXIT_TIMEOUT_S))
    from fusedpar.integrations.hf import parallelize
    from tests.integrations.hf_models import make_model

    model = parallelize(make_model("llama", seed=0), ParallelLayout(world, sp=2, tp=2), shift_threshold=4)
    calls = []
    if rank == 3:
        def die(module, args, kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(17)
        model.register_forward_pre_hook(die, with_kwargs=True)
    ids = torch.randint(5, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    dist.barrier()
    start = time.monotonic()
    try:
        model.generate(ids, max_new_tokens=12, do_sample=False)
        error = None
    except Exception as e:  # any error is the expected outcome; its kind is recorded
        error = f"{type(e).__name__}: {e}"[:500]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"elapsed": time.monotonic() - start, "error": error}, f)
    time.sleep(3 * EXIT_TIMEOUT_S)  # alive, like a server process, until the test ends it
    os._exit(0)


def test_every_survivor_of_a_dead_rank_raises_within_the_timeout(tmp_path):
    import json

    import pytest
    import torch.multiprocessing as mp

    pytest.importorskip("transformers")
    ctx = mp.get_context("spawn")
    init_file = str(tmp_path / "pg")
    procs = [ctx.Process(target=_exit_worker, args=(r, 4, init_file, str(tmp_path)), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all((tmp_path / f"rank{r}.json").exists() for r in range(3)):
            time.sleep(0.5)
        res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)
               if (tmp_path / f"rank{r}.json").exists()}
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert procs[3].exitcode in (17, -9), procs[3].exitcode
    assert sorted(res) == [0, 1, 2], f"survivors that never returned: {sorted(set(range(3)) - set(res))}"
    for r, out in res.items():
        assert out["error"] is not None, f"rank {r}: generate returned although rank 3 died"
        assert out["elapsed"] < EXIT_TIMEOUT_S + 10, f"rank {r} raised after {out['elapsed']:.1f} s: {out['error']}"
