import os

import torch

# The Triton kernels' own tests (test_kernels.py) run them through triton's
# interpreter on CPU tensors where there is no GPU (CI). Triton reads the flag
# when it is first imported, so it is set here, before anything imports it; on
# a GPU machine those tests JIT-compile the kernels for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# cuBLAS is deterministic only with a fixed workspace; torch requires this under
# torch.use_deterministic_algorithms(True) (test_autograd_and_dtypes.py).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

# tests/frameworks/ import frameworks whose pins clash with the test command's environment (verl, axolotl): .ci/run
# runs each file, named, in an environment of its own; collecting tests/ leaves them out.
collect_ignore = ["frameworks"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # With FUSED_CE_STRICT_SKIPS (.ci/run sets it) a test may skip only for a missing GPU: any other skip
    # (a missing package, an old torch) is a failure, so a green CI cannot hide untested code.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("FUSED_CE_STRICT_SKIPS") and "needs a CUDA device" not in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped, and only a missing GPU may skip a test here: {report.longrepr}"


def pytest_collection_modifyitems(config, items):
    # The `cuda` marker (registered in pyproject.toml): such tests skip, and only they, without a CUDA device.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
