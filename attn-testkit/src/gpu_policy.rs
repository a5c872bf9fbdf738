//! Whether a missing GPU, driver or GPU library may skip a test: with `ATTN_REQUIRE_GPU=1`
//! (set by `cargo xtask test` for its GPU steps when `nvidia-smi` lists a GPU, and by
//! `scripts/device-check.sh` to the number of GPUs it lists; any count of 1 or more
//! requires one) every such skip is a failure that names what is missing. The Python
//! tests read the same variable (`attn-python/tests/gpu_policy.py`).

use std::fmt::Display;

use attn_core::AttnError;

/// The environment variable that turns GPU skips into failures.
pub const REQUIRE_GPU_VAR: &str = "ATTN_REQUIRE_GPU";

/// Whether a GPU test may skip where it cannot run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuPolicy {
    /// `ATTN_REQUIRE_GPU=1` (or more): a test that cannot run fails.
    Required,
    MaySkip,
}

impl GpuPolicy {
    /// The policy `ATTN_REQUIRE_GPU` sets.
    pub fn from_env() -> Self {
        Self::from_value(std::env::var(REQUIRE_GPU_VAR).ok().as_deref())
    }

    /// The policy of the variable's value: a count of 1 or more GPUs requires them.
    pub fn from_value(value: Option<&str>) -> Self {
        if value.and_then(|v| v.trim().parse::<u32>().ok()).is_some_and(|n| n >= 1) {
            GpuPolicy::Required
        } else {
            GpuPolicy::MaySkip
        }
    }
}

/// Whether `ATTN_REQUIRE_GPU=1` is set.
pub fn gpu_required() -> bool {
    GpuPolicy::from_env() == GpuPolicy::Required
}

/// The message of a GPU test that cannot run, or `None` where it may skip.
pub fn required_failure(test: &str, reason: &dyn Display, policy: GpuPolicy) -> Option<String> {
    (policy == GpuPolicy::Required)
        .then(|| format!("{test}: {REQUIRE_GPU_VAR}=1 but the GPU test cannot run: {reason}"))
}

/// Skip the GPU test `test` for `reason` (printing `SKIP test: reason`), or panic with the
/// reason when `ATTN_REQUIRE_GPU=1`.
pub fn skip_gpu_test(test: &str, reason: impl Display) {
    if let Some(msg) = required_failure(test, &reason, GpuPolicy::from_env()) {
        panic!("{msg}");
    }
    println!("SKIP {test}: {reason}");
}

/// What opening a GPU resource (`opened`, e.g. `CudaDevice::new(0)`) gave: the resource, or
/// `None` after [`skip_gpu_test`] where the backend is unavailable (no driver, NVRTC or
/// device); any other error is a bug and panics.
pub fn gpu_or_skip<T>(test: &str, opened: Result<T, AttnError>) -> Option<T> {
    match opened {
        Ok(x) => Some(x),
        Err(e @ AttnError::BackendUnavailable { .. }) => {
            skip_gpu_test(test, e);
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed with an unexpected error: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_required_gpu_turns_the_skip_into_a_failure_naming_the_reason() {
        let reason = "libcuda (the NVIDIA driver library) was not found";
        let msg = required_failure("cuda_golden", &reason, GpuPolicy::Required).expect("required: a failure");
        assert!(msg.contains("cuda_golden") && msg.contains("libcuda") && msg.contains(REQUIRE_GPU_VAR), "{msg}");
        assert_eq!(required_failure("cuda_golden", &reason, GpuPolicy::MaySkip), None);
    }

    #[test]
    fn a_count_of_one_or_more_gpus_requires_them() {
        for v in ["1", "2", " 8 "] {
            assert_eq!(GpuPolicy::from_value(Some(v)), GpuPolicy::Required, "{v}");
        }
        for v in [None, Some("0"), Some(""), Some("yes")] {
            assert_eq!(GpuPolicy::from_value(v), GpuPolicy::MaySkip, "{v:?}");
        }
    }
}
