"""`gpu_policy`: ATTN_REQUIRE_GPU=N turns the skip of a test needing up to N GPUs into a
failure naming the test and the reason; unset, 0 or not a number, the test may skip."""

from __future__ import annotations

from gpu_policy import REQUIRE_GPU_VAR, required_failure, required_gpus


def test_a_required_gpu_turns_the_skip_into_a_failure_naming_the_reason():
    reason = "torch sees no CUDA device"
    msg = required_failure("the CUDA tests", reason, gpus=1, required=1)
    assert msg is not None and "the CUDA tests" in msg and reason in msg and REQUIRE_GPU_VAR in msg, msg
    assert required_failure("the CUDA tests", reason, gpus=1, required=0) is None
    # A test of two GPUs fails only where two are required.
    assert required_failure("two", "one device", gpus=2, required=1) is None
    assert required_failure("two", "one device", gpus=2, required=2) is not None


def test_the_variable_is_a_gpu_count():
    assert [required_gpus(v) for v in ("1", " 2 ", "0", "", "yes", "-1")] == [1, 2, 0, 0, 0, 0]
