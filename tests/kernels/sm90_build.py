"""Build Triton kernels for Hopper (sm_90) on a machine without a GPU, for the tests that check what the
interpreter never builds: a script run in a subprocess without TRITON_INTERPRET, in a fresh Triton cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_for_sm90(script: str, arg, tmp_path, timeout: int = 600):
    """Run `script` (python -c; sys.argv[1] is `arg` as JSON) with Triton compiling, not interpreting, and its
    cache in tmp_path (a fresh build, not a cached one); the JSON of its last stdout line. A failed build fails
    the calling test with the end of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, f"sm_90 build failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])
