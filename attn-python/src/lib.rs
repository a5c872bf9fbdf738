//! `attn_dilated._native`: the dilated attention of `attn` for PyTorch tensors, on the
//! CPU and (feature `cuda`) on CUDA devices.
//!
//! The Python package (`python/attn_dilated`) is the public API; this module is its
//! private back end. A call receives each tensor as `(data_ptr, shape, stride, dtype)`
//! (`raw`), computes in place on the tensors' memory with the interpreter released
//! (`call` on the CPU; `cuda_call` queues the kernels on the caller's CUDA stream), and
//! turns every `AttnError` into a Python exception (`errors`). Outputs are tensors the
//! Python side allocated, so nothing is copied on the way out.

mod alloc_count;
mod call;
mod cuda_call;
mod errors;
mod nccl_ring;
pub mod raw;
mod ring_call;
mod torch_p2p;

use attn_core::{BlockMaskBuf, BlockPattern, Causality, DilatedConfig, Mixing};
use pyo3::prelude::*;

use crate::call::{BackwardArgs, ForwardArgs, MaskArgs};
use crate::cuda_call::Placement;
use crate::errors::to_py;
use crate::nccl_ring::{CudaCall, NcclLinkSlot, RowsBackward};
use crate::raw::RawTensor;
use crate::ring_call::RingSetup;

/// A validated attention config (dilated patterns mixed by head groups or LongNet, or a
/// sliding window); invalid values raise `ValueError` when it is built.
#[pyclass(frozen, name = "Config", module = "attn_dilated._native")]
#[derive(Debug)]
struct PyConfig {
    cfg: DilatedConfig,
}

/// `causal` or `full` (the Python side maps its `is_causal` flag to these names).
fn parse_causality(s: &str) -> PyResult<Causality> {
    match s {
        "causal" => Ok(Causality::Causal),
        "full" => Ok(Causality::Full),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!("causality `{other}`: expected causal or full"))),
    }
}

#[pymethods]
impl PyConfig {
    /// `mixing` is `head_groups`, `longnet` or `window` (None: the default for the
    /// pattern kind); `window` is `(left, right)` and excludes segments and rates.
    #[new]
    #[pyo3(signature = (segment_lengths, dilation_rates, mixing=None, causality="full", scale=None, window=None))]
    fn new(
        segment_lengths: Vec<usize>,
        dilation_rates: Vec<usize>,
        mixing: Option<&str>,
        causality: &str,
        scale: Option<f64>,
        window: Option<(usize, usize)>,
    ) -> PyResult<Self> {
        let mut b = DilatedConfig::builder()
            .segments(&segment_lengths)
            .dilations(&dilation_rates)
            .causality(parse_causality(causality)?)
            .maybe_scale(scale);
        if let Some((left, right)) = window {
            b = b.window(left, right);
        }
        if let Some(m) = mixing {
            b = b.mixing(Mixing::parse(m).map_err(to_py)?);
        }
        Ok(PyConfig { cfg: b.build().map_err(to_py)? })
    }

    /// Raise `ValueError` if `heads` query heads do not fit the config (head groups
    /// need at least one head per pattern).
    fn validate_heads(&self, heads: usize) -> PyResult<()> {
        self.cfg.validate_heads(heads).map_err(to_py)
    }

    #[getter]
    fn mixing(&self) -> &'static str {
        self.cfg.mixing().as_str()
    }

    #[getter]
    fn causal(&self) -> bool {
        self.cfg.causal()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// Forward: write `out` (q's shape and dtype) and `lse` (float32 `[batch, seq, heads]`).
/// On the CPU with `threads` threads; with `cuda=(device, stream)` the tensors are CUDA
/// tensors of `device` and the kernels are queued on the stream whose raw handle is
/// `stream` (the caller's current stream), without synchronising. `block_mask` (bool or
/// uint8 `[batch or 1, heads or 1, q_blocks, k_blocks]`, 1 = kept) goes with `block_size`.
#[pyfunction]
#[pyo3(signature = (cfg, q, k, v, out, lse, key_padding_mask=None, cu_seqlens=None, threads=1, cuda=None, block_mask=None, block_size=None))]
#[allow(clippy::too_many_arguments)]
fn forward(
    py: Python<'_>,
    cfg: &Bound<'_, PyConfig>,
    q: RawTensor,
    k: RawTensor,
    v: RawTensor,
    out: RawTensor,
    lse: RawTensor,
    key_padding_mask: Option<RawTensor>,
    cu_seqlens: Option<Vec<i64>>,
    threads: usize,
    cuda: Option<(usize, usize)>,
    block_mask: Option<RawTensor>,
    block_size: Option<usize>,
) -> PyResult<()> {
    let args = ForwardArgs { q, k, v, out, lse };
    let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
    let cfg = &cfg.get().cfg;
    match cuda {
        Some((device, stream)) => cuda_call::forward(py, cfg, &args, &masks, Placement { device, stream }),
        None => call::forward(py, cfg, &args, &masks, threads),
    }
    .map_err(to_py)
}

/// Backward: write `dq`, `dk`, `dv` (the gradients of `sum(out * grad_out) + sum(lse *
/// grad_lse)`) from the inputs, the forward's `out` and `lse`, `grad_out` and the optional
/// float32 `grad_lse` (the LSE's sizes, contiguous); `threads`, `cuda` and the block mask
/// as in [`forward`].
#[pyfunction]
#[pyo3(signature = (cfg, q, k, v, out, lse, grad_out, dq, dk, dv, key_padding_mask=None, cu_seqlens=None, threads=1, cuda=None, grad_lse=None, scratch=None, block_mask=None, block_size=None))]
#[allow(clippy::too_many_arguments)]
fn backward(
    py: Python<'_>,
    cfg: &Bound<'_, PyConfig>,
    q: RawTensor,
    k: RawTensor,
    v: RawTensor,
    out: RawTensor,
    lse: RawTensor,
    grad_out: RawTensor,
    dq: RawTensor,
    dk: RawTensor,
    dv: RawTensor,
    key_padding_mask: Option<RawTensor>,
    cu_seqlens: Option<Vec<i64>>,
    threads: usize,
    cuda: Option<(usize, usize)>,
    grad_lse: Option<RawTensor>,
    scratch: Option<RawTensor>,
    block_mask: Option<RawTensor>,
    block_size: Option<usize>,
) -> PyResult<()> {
    let args = BackwardArgs { q, k, v, out, lse, grad_out, dq, dk, dv, grad_lse, scratch };
    let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
    let cfg = &cfg.get().cfg;
    match cuda {
        Some((device, stream)) => cuda_call::backward(py, cfg, &args, &masks, Placement { device, stream }),
        None => call::backward(py, cfg, &args, &masks, threads),
    }
    .map_err(to_py)
}

/// One rank of a ring over a torch.distributed group: its rank and world size in the
/// group, the layout (`contiguous` or `zigzag`), the strategy (`auto`, `ring`,
/// `allgather`, `ulysses`, `hybrid:U`), the timeout of every round in seconds and the
/// compute threads. `forward` and `backward` take the Python transport object (see
/// `attn_dilated.distributed`) and this rank's rows; masks are whole-sequence values.
#[pyclass(frozen, name = "Ring", module = "attn_dilated._native")]
#[derive(Debug)]
struct PyRing {
    setup: RingSetup,
}

#[pymethods]
impl PyRing {
    #[new]
    #[pyo3(signature = (rank, world, layout, strategy, timeout, threads=1))]
    fn new(rank: usize, world: usize, layout: &str, strategy: &str, timeout: f64, threads: usize) -> PyResult<Self> {
        if world == 0 || rank >= world {
            return Err(to_py(attn_core::AttnError::InvalidArgument(format!(
                "rank {rank} outside a world of {world} ranks"
            ))));
        }
        let timeout =
            std::time::Duration::try_from_secs_f64(timeout).ok().filter(|t| !t.is_zero()).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout {timeout} s: expected a positive number of seconds"
                ))
            })?;
        let layout = attn_ring::Layout::parse(layout).map_err(to_py)?;
        let strategy = attn_ring::Strategy::parse(strategy).map_err(to_py)?;
        Ok(PyRing { setup: RingSetup { rank, world, layout, strategy, timeout, threads } })
    }

    /// This rank's forward: writes `out` and `lse` (this rank's rows).
    #[pyo3(signature = (cfg, transport, q, k, v, out, lse, key_padding_mask=None, cu_seqlens=None, block_mask=None, block_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        cfg: &Bound<'_, PyConfig>,
        transport: Py<PyAny>,
        q: RawTensor,
        k: RawTensor,
        v: RawTensor,
        out: RawTensor,
        lse: RawTensor,
        key_padding_mask: Option<RawTensor>,
        cu_seqlens: Option<Vec<i64>>,
        block_mask: Option<RawTensor>,
        block_size: Option<usize>,
    ) -> PyResult<()> {
        let args = ForwardArgs { q, k, v, out, lse };
        let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
        ring_call::forward(py, &self.setup, transport, &cfg.get().cfg, &args, &masks).map_err(to_py)
    }

    /// This rank's backward: writes `dq`, `dk`, `dv` (this rank's rows) from `grad_out`
    /// and the optional float32 `grad_lse`.
    #[pyo3(signature = (cfg, transport, q, k, v, out, lse, grad_out, dq, dk, dv, key_padding_mask=None, cu_seqlens=None, grad_lse=None, block_mask=None, block_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        py: Python<'_>,
        cfg: &Bound<'_, PyConfig>,
        transport: Py<PyAny>,
        q: RawTensor,
        k: RawTensor,
        v: RawTensor,
        out: RawTensor,
        lse: RawTensor,
        grad_out: RawTensor,
        dq: RawTensor,
        dk: RawTensor,
        dv: RawTensor,
        key_padding_mask: Option<RawTensor>,
        cu_seqlens: Option<Vec<i64>>,
        grad_lse: Option<RawTensor>,
        block_mask: Option<RawTensor>,
        block_size: Option<usize>,
    ) -> PyResult<()> {
        let args = BackwardArgs { q, k, v, out, lse, grad_out, dq, dk, dv, grad_lse, scratch: None };
        let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
        ring_call::backward(py, &self.setup, transport, &cfg.get().cfg, &args, &masks).map_err(to_py)
    }

    /// This rank's forward on CUDA tensors (feature `cuda`): its rows of q, k, v and the
    /// `out` and float32 `lse` it writes, each contiguous on the link's device, the chunk
    /// ring's rows moving over `link`'s NCCL communicator, the kernels queued on the raw
    /// CUDA stream `stream` of that device.
    #[pyo3(signature = (cfg, transport, link, stream, q, k, v, out, lse, key_padding_mask=None, cu_seqlens=None, block_mask=None, block_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward_cuda(
        &self,
        py: Python<'_>,
        cfg: &Bound<'_, PyConfig>,
        transport: Py<PyAny>,
        link: &Bound<'_, PyNcclLink>,
        stream: usize,
        q: RawTensor,
        k: RawTensor,
        v: RawTensor,
        out: RawTensor,
        lse: RawTensor,
        key_padding_mask: Option<RawTensor>,
        cu_seqlens: Option<Vec<i64>>,
        block_mask: Option<RawTensor>,
        block_size: Option<usize>,
    ) -> PyResult<()> {
        let args = ForwardArgs { q, k, v, out, lse };
        let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
        let handle = transport.clone_ref(py);
        let call = CudaCall { setup: &self.setup, slot: &link.get().slot, transport, cfg: &cfg.get().cfg, stream };
        ring_call::after_call(py, self.setup.rank, &handle, nccl_ring::forward(py, call, &args, &masks)).map_err(to_py)
    }

    /// This rank's backward on CUDA tensors: tensors as in `forward_cuda`, `grad_out`, the
    /// optional LSE gradient (a contiguous host float32 `[batch, rows, heads]` tensor) and
    /// the `dq`, `dk`, `dv` it writes.
    #[pyo3(signature = (cfg, transport, link, stream, q, k, v, grad_out, dq, dk, dv, grad_lse=None, key_padding_mask=None, cu_seqlens=None, block_mask=None, block_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn backward_cuda(
        &self,
        py: Python<'_>,
        cfg: &Bound<'_, PyConfig>,
        transport: Py<PyAny>,
        link: &Bound<'_, PyNcclLink>,
        stream: usize,
        q: RawTensor,
        k: RawTensor,
        v: RawTensor,
        grad_out: RawTensor,
        dq: RawTensor,
        dk: RawTensor,
        dv: RawTensor,
        grad_lse: Option<RawTensor>,
        key_padding_mask: Option<RawTensor>,
        cu_seqlens: Option<Vec<i64>>,
        block_mask: Option<RawTensor>,
        block_size: Option<usize>,
    ) -> PyResult<()> {
        let args = RowsBackward { q, k, v, grad_out, grad_lse, dq, dk, dv };
        let masks = MaskArgs { key_padding: key_padding_mask, cu_seqlens, block_mask, block_size };
        let handle = transport.clone_ref(py);
        let call = CudaCall { setup: &self.setup, slot: &link.get().slot, transport, cfg: &cfg.get().cfg, stream };
        ring_call::after_call(py, self.setup.rank, &handle, nccl_ring::backward(py, call, &args, &masks)).map_err(to_py)
    }

    /// The global positions of `rank`'s rows for a sequence of `seq` rows, as
    /// `(start, end)` ranges (the layout's split).
    #[staticmethod]
    fn layout_ranges(layout: &str, seq: usize, world: usize, rank: usize) -> PyResult<Vec<(usize, usize)>> {
        let layout = attn_ring::Layout::parse(layout).map_err(to_py)?;
        layout.check(seq, world).map_err(to_py)?;
        Ok(layout.ranges(seq, world, rank).into_iter().map(|r| (r.start, r.end)).collect())
    }
}

/// One rank's NCCL communicator for the CUDA ring's rows on one device: rank `rank` of
/// `world`, joined from the 128-byte unique id `id` that rank 0 of the group made
/// (`nccl_unique_id`) and broadcast, waiting at most `timeout` seconds for every rank.
/// The Python side keeps one per (group, device).
#[pyclass(frozen, name = "NcclLink", module = "attn_dilated._native")]
#[derive(Debug)]
struct PyNcclLink {
    slot: NcclLinkSlot,
}

#[pymethods]
impl PyNcclLink {
    #[new]
    fn new(py: Python<'_>, rank: usize, world: usize, device: usize, id: Vec<u8>, timeout: f64) -> PyResult<Self> {
        let timeout =
            std::time::Duration::try_from_secs_f64(timeout).ok().filter(|t| !t.is_zero()).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout {timeout} s: expected a positive number of seconds"
                ))
            })?;
        let slot = py.detach(|| NcclLinkSlot::join(rank, world, device, &id, timeout)).map_err(to_py)?;
        Ok(PyNcclLink { slot })
    }

    #[getter]
    fn device(&self) -> usize {
        self.slot.device
    }
}

/// A fresh NCCL unique id (128 bytes), for rank 0 of a group to broadcast.
#[pyfunction]
fn nccl_unique_id(py: Python<'_>) -> PyResult<Vec<u8>> {
    py.detach(nccl_ring::unique_id).map_err(to_py)
}

/// Why CUDA tensors cannot take the ring across ranks on `device` (a wheel built without
/// `cuda`, no driver, NCCL, NVRTC or device), naming the fix; `None` where they can.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn ring_cuda_unavailable_reason(py: Python<'_>, device: usize) -> Option<String> {
    py.detach(|| nccl_ring::unavailable_reason(device))
}

/// Why the CUDA kernels cannot run on device `device` (built without the `cuda` feature,
/// no driver, NVRTC or device, a device older than sm_80), or `None` where they can.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn cuda_unavailable_reason(py: Python<'_>, device: usize) -> Option<String> {
    py.detach(|| cuda_call::unavailable_reason(device))
}

/// Search `dirs` for libnvrtc too, after the dynamic linker's path (effective until one
/// has loaded).
#[pyfunction]
fn add_library_search_dirs(dirs: Vec<String>) {
    cuda_call::add_library_search_dirs(dirs);
}

/// `(file, (major, minor))` of the libnvrtc the CUDA kernels compile with; RuntimeError
/// saying what was searched where none loads.
#[pyfunction]
fn nvrtc_library(py: Python<'_>) -> PyResult<(String, (i32, i32))> {
    py.detach(cuda_call::nvrtc_library).map_err(to_py)
}

/// The block mask `[q_blocks, k_blocks]` (row-major bytes, 1 = kept) of the Python
/// library's `SparsePatternConfig` for `q_len` queries and `k_len` keys: its
/// `pattern_type` (`local_window`, `dilated_sparse` or `global_local`) with
/// `local_window_size`, `global_tokens`, `block_size` and the module's dilation rates,
/// mapped as the definition's "Block masks" says. Returns `(bytes, q_blocks, k_blocks)`;
/// an unknown pattern type or a zero block size raises ValueError.
#[pyfunction]
fn sparse_pattern_mask(
    pattern_type: &str,
    local_window_size: usize,
    global_tokens: usize,
    block_size: usize,
    dilation_rates: Vec<usize>,
    q_len: usize,
    k_len: usize,
) -> PyResult<(Vec<u8>, usize, usize)> {
    let pattern =
        BlockPattern::from_sparse_config(pattern_type, local_window_size, global_tokens, block_size, &dilation_rates)
            .map_err(to_py)?;
    let buf = BlockMaskBuf::from_pattern(&pattern, block_size, q_len, k_len).map_err(to_py)?;
    let mask = buf.view();
    let dims = mask.dims();
    Ok((mask.keep().to_vec(), dims.q_blocks, dims.k_blocks))
}

/// The CPU kernel flavour in use (`avx512`, `avx2`, `portable`, ...), for reports.
#[pyfunction]
fn cpu_isa() -> &'static str {
    attn_kernels::isa::Isa::detect().as_str()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyConfig>()?;
    m.add_class::<PyRing>()?;
    m.add_class::<PyNcclLink>()?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(ring_cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_isa, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_pattern_mask, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(add_library_search_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_library, m)?)?;
    m.add_function(wrap_pyfunction!(alloc_count::allocation_window_start, m)?)?;
    m.add_function(wrap_pyfunction!(alloc_count::allocation_peak, m)?)?;
    Ok(())
}
