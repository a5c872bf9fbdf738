"""Whether a test that cannot reach a GPU may skip (attn-testkit's `gpu_policy`, the same
variable): `ATTN_REQUIRE_GPU=N` with N >= 1 (the device check sets the number of GPUs
nvidia-smi lists) makes a test that needs up to N GPUs fail, naming what is missing,
instead of skipping; unset or 0, it skips with the reason."""

from __future__ import annotations

import os

import pytest

REQUIRE_GPU_VAR = "ATTN_REQUIRE_GPU"


def required_gpus(value: str | None = None) -> int:
    """The GPU count `ATTN_REQUIRE_GPU` requires (0: tests may skip)."""
    value = os.environ.get(REQUIRE_GPU_VAR) if value is None else value
    try:
        return max(int((value or "").strip()), 0)
    except ValueError:
        return 0


def required_failure(test: str, reason: str, gpus: int = 1, required: int | None = None) -> str | None:
    """The failure message of a test needing `gpus` GPUs that cannot run for `reason`, or
    None where it may skip."""
    required = required_gpus() if required is None else required
    if required >= gpus:
        return f"{test}: {REQUIRE_GPU_VAR}={required} but the GPU test cannot run: {reason}"
    return None


def skip_gpu_test(test: str, reason: str, gpus: int = 1) -> None:
    """Skip the test needing `gpus` GPUs for `reason`, or fail it where `ATTN_REQUIRE_GPU`
    requires that many."""
    msg = required_failure(test, reason, gpus)
    if msg is not None:
        pytest.fail(msg)
    pytest.skip(reason)
