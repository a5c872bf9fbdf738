//! Errors at the candle boundary: every [`AttnError`] becomes a candle error that keeps
//! its message (`candle_core::Error::wrap`), and the checks candle itself would not make
//! (rank, dtype, device of the inputs) are typed `AttnError`s before any op runs.

use attn_core::{AttnError, Feature, TensorName};
use candle_core::{DType, Device, Tensor};

/// `err` as a candle error carrying its message.
pub fn to_candle(err: AttnError) -> candle_core::Error {
    candle_core::Error::wrap(err)
}

/// `Err(to_candle(err))`, for `?` at the boundary.
pub(crate) fn fail<R>(err: AttnError) -> candle_core::Result<R> {
    Err(to_candle(err))
}

/// The name candle gives a dtype, for messages.
fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

/// What an op does with tensors on a CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnCuda {
    /// Computes them with the workspace's CUDA kernels (feature `cuda`).
    Kernels,
    /// Refuses them: the op's backend computes on the host.
    Refuse,
}

/// Checks that `t` is a rank-4 tensor of a dtype the kernels compute (f32, bf16, f16)
/// on a device the op takes (`on_cuda`) and, when `like` is given, of that dtype.
pub(crate) fn check_input(
    name: TensorName,
    t: &Tensor,
    like: Option<DType>,
    on_cuda: OnCuda,
) -> candle_core::Result<()> {
    if t.rank() != 4 {
        return fail(AttnError::RankMismatch { tensor: name, expected: 4, got: t.rank() });
    }
    let supported = [DType::F32, DType::BF16, DType::F16];
    match like {
        Some(want) if t.dtype() != want => {
            let expected = match want {
                DType::F32 => "f32 (q's dtype)",
                DType::BF16 => "bf16 (q's dtype)",
                _ => "f16 (q's dtype)",
            };
            return fail(AttnError::DTypeMismatch { tensor: name, expected, got: dtype_name(t.dtype()) });
        }
        None if !supported.contains(&t.dtype()) => {
            let got = dtype_name(t.dtype());
            return fail(AttnError::DTypeMismatch { tensor: name, expected: "f32, bf16 or f16", got });
        }
        _ => {}
    }
    check_device(t.device(), on_cuda)
}

/// The host kernels take host tensors; the CUDA kernels take CUDA tensors where the op
/// uses them and the `cuda` feature is on. Any other device is an error naming why.
pub(crate) fn check_device(device: &Device, on_cuda: OnCuda) -> candle_core::Result<()> {
    match (device, on_cuda) {
        (Device::Cpu, _) => Ok(()),
        (Device::Cuda(_), OnCuda::Kernels) if cfg!(feature = "cuda") => Ok(()),
        (Device::Cuda(_), OnCuda::Kernels) => fail(AttnError::NotCompiled { backend: "cuda", feature: "cuda" }),
        (Device::Cuda(_), OnCuda::Refuse) => fail(AttnError::Unsupported {
            backend: "candle",
            feature: Feature::Other(
                "tensors on a CUDA device with a host backend (dilated_attention runs the CUDA kernels)",
            ),
        }),
        (Device::Metal(_), _) => {
            fail(AttnError::Unsupported { backend: "candle", feature: Feature::Other("tensors on a Metal device") })
        }
    }
}
