"""Shared test setup.

CPU (CI): Triton kernels run on the Triton interpreter. Triton 3.6 decides interpreter vs
compiler when `@triton.jit` decorates a kernel (runtime/jit.py reads knobs.runtime.interpret),
i.e. when a fusedpar.kernels module is first imported, so TRITON_INTERPRET must be set before
any test module is imported: this root conftest is the one place that is early enough for all.
GPU: tests marked `gpu` run under torchrun (`bash perf/run_gpu.sh`) and use `nccl_world`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def decode_gemm_rows(max_rows: int):
    """Inside: the routing table's decode_gemm_max_rows is max_rows on every device (fusedpar.kernels.routing), so
    FusedComm's GEMMs with nothing to exchange take the decode GEMM up to that many rows whatever the table
    measured (tests of the routed path; spawned ranks enter it themselves)."""
    from fusedpar.kernels import routing

    real = routing.thresholds
    routing.thresholds = lambda device, world: dataclasses.replace(real(device, world), decode_gemm_max_rows=max_rows)
    try:
        yield
    finally:
        routing.thresholds = real


def _fix_interpreter_for_numpy_2_4() -> None:
    """Work around triton-lang/triton#9171 (triton 3.6 interpreter + numpy >= 2.4).

    The interpreter keeps scalars as 1-element arrays and converts them with int(array), which
    numpy 2.4 turned into a TypeError; every `for i in range(tensor_bound)` in a kernel then
    fails. Re-define the patched tensor.__index__ the way the upstream fix does (squeeze first).
    Applied only when numpy actually rejects the conversion; a no-op once triton is fixed.
    """
    try:
        int(np.array([1]))
    except TypeError:
        pass
    else:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_fusedpar_numpy24_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._fusedpar_numpy24_fix = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_for_numpy_2_4()


def pytest_addoption(parser):
    parser.addoption("--deep", action="store_true", default=False,
                     help="the deep test profile (tests/profile.py): also the tests marked `deep` (every model "
                          "family and configuration of the vLLM engine tests), more property-test examples")


def pytest_configure(config):
    from tests import profile

    profile.DEEP = config.getoption("deep")


# The modules that take longest, longest first: `python -m pytest -n 2` hands whole modules to its two
# workers in collection order (pytest_xdist_make_scheduler), so these start first and the short ones fill in.
LONGEST_FIRST = (
    "tests/integrations/test_vllm.py",
    "tests/kernels/test_gemm_all_reduce.py",
    "tests/kernels/test_attention.py",
    "tests/integrations/test_hf_reshard.py",
    "tests/layers/test_kv_reshard.py",
    "tests/layers/test_decoder_dist.py",
    "tests/kernels/test_ulysses.py",
    "tests/integrations/test_hf.py",
    "tests/kernels/test_sm90_compile.py",
    "tests/integrations/test_hf_step_orders.py",
)


def pytest_collection_modifyitems(config, items):
    """Outside the deep profile, deselect the tests marked `deep` (as `-m` deselects the `gpu` ones);
    then put the modules of LONGEST_FIRST first (a stable sort: the rest keep their order)."""
    if not config.getoption("deep"):
        deep = [item for item in items if item.get_closest_marker("deep") is not None]
        if deep:
            config.hook.pytest_deselected(items=deep)
            items[:] = [item for item in items if item.get_closest_marker("deep") is None]
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


if importlib.util.find_spec("xdist") is not None:  # pytest refuses a hook no installed plugin declares

    def pytest_xdist_make_scheduler(config, log):
        """Under pytest-xdist (-n N): whole modules per worker (module fixtures, engines and process pools
        are shared by a module's tests), handed out in collection order."""
        from xdist.scheduler import LoadFileScheduling

        config.option.loadscopereorder = False
        return LoadFileScheduling(config, log)


def pytest_sessionstart(session):
    """Under torchrun, make this process's GPU (LOCAL_RANK) the current CUDA device before any test runs.

    Single-GPU tests put their tensors on cuda:LOCAL_RANK (fusedpar.testing.gpu.local_device); left at
    cuda:0, streams and graph captures made without a device land on GPU 0 while the kernels run on the
    tensors' GPU: a capture records nothing (an empty graph), and later launches can run with GPU 0's
    context current ("Pointer argument cannot be accessed from Triton"). One process, one GPU.
    """
    from fusedpar.testing.gpu import launched_by_torchrun, local_device

    if torch.cuda.is_available() and launched_by_torchrun():
        torch.cuda.set_device(local_device())


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """End run_distributed's kept gloo processes while the session is still open: they leave, and write
    what a process writes at its exit (coverage data), before anything reports."""
    from fusedpar.testing.dist import close_pools

    close_pools()


@pytest.fixture(scope="session")
def nccl_world():
    """(rank, world_size) of an NCCL process group made from torchrun's environment; skips otherwise.

    Session-scoped and never torn down, so every GPU test shares one process group.
    """
    from fusedpar.testing.gpu import init_torchrun_nccl, launched_by_torchrun

    if not torch.cuda.is_available() or not launched_by_torchrun():
        pytest.skip("needs CUDA and a torchrun launch (see perf/run_gpu.sh)")
    return init_torchrun_nccl()
