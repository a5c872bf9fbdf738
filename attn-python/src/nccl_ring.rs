//! Ring attention on CUDA tensors across torch.distributed ranks (feature `cuda`): the
//! chunk ring (`attn_ring::chunk_ring::{chunk_forward, chunk_backward}`) with its blocks on
//! the CUDA kernels (`CudaChunks`, queued on the caller's current stream) and its k/v rows
//! and dk/dv moving by attn's own NCCL communicator (`NcclDeviceTransport`), while the
//! handshake, the completion rounds and each step's header travel over the group's
//! [`TorchP2p`](crate::torch_p2p::TorchP2p) rounds, as on the CPU path.
//!
//! The NCCL communicator is a [`NcclLinkSlot`]: joined once per (group, device) from a
//! unique id rank 0 made and broadcast over the group (the Python side does both), then
//! lent to each call and taken back. A rank's rows arrive as one contiguous tensor; each
//! piece of its layout (one under `contiguous`, up to two under `zigzag`) is copied device
//! to device into the ring's buffers, and the ring's results are copied back into the
//! tensors the Python side allocated, so outputs, LSEs and gradients stay on the device.

use std::time::Duration;

use attn_core::{AttnError, DilatedConfig, Result};
use pyo3::Python;

use crate::call::{ForwardArgs, MaskArgs};
use crate::raw::RawTensor;
use crate::ring_call::RingSetup;

/// A backward call's tensors, each the rank's rows (its layout's ranges, in order) as one
/// contiguous tensor on the link's device, as a forward call's [`ForwardArgs`] are: q, k,
/// v, `grad_out`, the optional LSE gradient (a contiguous float32 `[batch, rows, heads]`
/// host tensor), and the `dq`, `dk`, `dv` it writes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug)]
pub struct RowsBackward {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub grad_out: RawTensor,
    pub grad_lse: Option<RawTensor>,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
}

/// Rank `rank` of `world` in an NCCL communicator on CUDA device `device`, joined from a
/// unique id every rank of the group received from rank 0.
#[derive(Debug)]
pub struct NcclLinkSlot {
    pub device: usize,
    #[cfg(feature = "cuda")]
    link: std::sync::Mutex<Option<attn_ring::chunk_ring::NcclDeviceLink>>,
}

impl NcclLinkSlot {
    /// Join communicator `id` (128 bytes) as `rank` of `world` on `device`, waiting at most
    /// `timeout` for the other ranks.
    pub fn join(rank: usize, world: usize, device: usize, id: &[u8], timeout: Duration) -> Result<Self> {
        #[cfg(feature = "cuda")]
        return imp::join(rank, world, device, id, timeout);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (rank, world, device, id, timeout);
            Err(not_compiled())
        }
    }
}

/// A fresh NCCL unique id (128 bytes) for rank 0 to broadcast.
pub fn unique_id() -> Result<Vec<u8>> {
    #[cfg(feature = "cuda")]
    return attn_ring::comm::NcclComm::unique_id().map(|id| id.to_vec());
    #[cfg(not(feature = "cuda"))]
    Err(not_compiled())
}

/// Why CUDA tensors cannot take the ring on `device` (no `cuda` feature, no driver, NCCL,
/// NVRTC or device), with what would fix it; `None` where they can.
pub fn unavailable_reason(device: usize) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        // The kernels' reason first (driver, NVRTC, device), then NCCL's.
        let nccl = || {
            attn_ring::comm::nccl_available().err().map(|e| {
                format!(
                    "{e}; NCCL is loaded at run time: install the NVIDIA NCCL wheel of your CUDA (nvidia-nccl-cu12 or \
                 nvidia-nccl-cu13, which CUDA builds of PyTorch bring) or name libnccl.so.2 in ATTN_NCCL_PATH"
                )
            })
        };
        crate::cuda_call::unavailable_reason(device).or_else(nccl)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Some(format!(
            "{}: rebuild attn_dilated with it (`pip install ./attn-python` or `maturin build --features cuda`, as \
             pyproject.toml's maturin settings do)",
            not_compiled()
        ))
    }
}

#[cfg(not(feature = "cuda"))]
fn not_compiled() -> AttnError {
    AttnError::NotCompiled { backend: "cuda", feature: "cuda" }
}

/// What one CUDA ring call runs with: the rank's setup, the group's NCCL link, the
/// Python transport of the control rounds, the config, and the raw handle of the CUDA
/// stream the kernels queue on (the caller's current stream on the link's device).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug)]
pub struct CudaCall<'a> {
    pub setup: &'a RingSetup,
    pub slot: &'a NcclLinkSlot,
    pub transport: pyo3::Py<pyo3::PyAny>,
    pub cfg: &'a DilatedConfig,
    pub stream: usize,
}

/// This rank's forward on CUDA tensors: writes `out` and `lse` on the call's stream.
pub fn forward(py: Python<'_>, call: CudaCall<'_>, args: &ForwardArgs, masks: &MaskArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use imp::forward as run;
        crate::cuda_call::unwinding_to_error(|| crate::call::by_dtype!(&args.q, run(py, call, args, masks)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, call, args, masks);
        Err(not_compiled())
    }
}

/// This rank's backward on CUDA tensors: writes `dq`, `dk` and `dv` on the call's stream.
pub fn backward(py: Python<'_>, call: CudaCall<'_>, args: &RowsBackward, masks: &MaskArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use imp::backward as run;
        crate::cuda_call::unwinding_to_error(|| crate::call::by_dtype!(&args.q, run(py, call, args, masks)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, call, args, masks);
        Err(not_compiled())
    }
}

/// The value ranges one copy of `n` rows moves, batch by batch: rows `from..from + n` of
/// a tensor of `src_rows` rows a batch to rows `to..to + n` of one of `dst_rows` rows a
/// batch, `width` values a row (`(source range, destination range)` per batch).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn run_spans(
    (batch, width): (usize, usize),
    (src_rows, from): (usize, usize),
    (dst_rows, to): (usize, usize),
    n: usize,
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    if n == 0 || width == 0 {
        return Vec::new();
    }
    (0..batch)
        .map(|b| {
            let s = (b * src_rows + from) * width;
            let d = (b * dst_rows + to) * width;
            (s..s + n * width, d..d + n * width)
        })
        .collect()
}

/// The check of a slot against the setup it serves: the same rank and world size.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn check_slot(setup: &RingSetup, rank: usize, world: usize) -> Result<()> {
    if (setup.rank, setup.world) != (rank, world) {
        return Err(AttnError::InvalidArgument(format!(
            "the NCCL link of rank {rank} of {world} cannot serve rank {} of {}",
            setup.rank, setup.world
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Mutex;
    use std::time::Duration;

    use attn_core::{AttnError, DilatedConfig, Result, Shape4, TensorName};
    use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceTensor, foreign_slice};
    use attn_ring::RingProblem;
    use attn_ring::chunk_ring::rank_pieces;
    use attn_ring::chunk_ring::{
        ChunkCompute, ChunkOptions, CudaChunks, DeviceRowStats, Metered, NcclDeviceLink, NcclDeviceTransport,
        chunk_backward, chunk_forward,
    };
    use attn_ring::comm::GroupedComm;
    use pyo3::Python;

    use crate::call::ForwardArgs;
    use crate::call::{MaskArgs, read_masks};
    use crate::cuda_call::{Placement, imp::on_stream};
    use crate::nccl_ring::{CudaCall, NcclLinkSlot, RowsBackward, check_slot, run_spans};
    use crate::raw::{Access, Checked, RawTensor, check_disjoint};
    use crate::ring_call::RingSetup;
    use crate::torch_p2p::TorchP2p;

    type Rows<T> = Metered<DeviceTensor<T>>;
    type Transport<T> = NcclDeviceTransport<GroupedComm<TorchP2p>, Rows<T>, Metered<DeviceRowStats>>;

    fn cuda_err(e: impl std::error::Error + Send + Sync + 'static) -> AttnError {
        AttnError::backend("cuda", e)
    }

    pub fn join(rank: usize, world: usize, device: usize, id: &[u8], timeout: Duration) -> Result<NcclLinkSlot> {
        let id: &[u8; attn_ring::comm::nccl_comm::NCCL_ID_BYTES] = id
            .try_into()
            .map_err(|_| AttnError::InvalidArgument(format!("an NCCL unique id is 128 bytes, got {}", id.len())))?;
        let dev = crate::cuda_call::imp::device(device)?;
        let link = NcclDeviceLink::join(rank, world, dev.context(), id, timeout)?;
        Ok(NcclLinkSlot { device, link: Mutex::new(Some(link)) })
    }

    impl NcclLinkSlot {
        /// A transport over the slot's link for one call (`control` carries the rest); an
        /// aborted link or one already lent is a `Comm` error.
        fn lend<T: CudaElement>(&self, setup: &RingSetup, control: GroupedComm<TorchP2p>) -> Result<Transport<T>> {
            let mut slot = self.link.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let link = slot.take().ok_or_else(|| AttnError::Comm {
                rank: setup.rank,
                message: "the group's NCCL link is in use by another call, or was lost to a failed one".into(),
            })?;
            let (rank, world) = link.place();
            if let Err(e) = check_slot(setup, rank, world).and_then(|()| link.usable()) {
                *slot = Some(link);
                return Err(e);
            }
            NcclDeviceTransport::over(link, control)
        }

        fn give_back<T: CudaElement>(&self, t: Transport<T>) {
            *self.link.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(t.into_link());
        }
    }

    /// A call's tensor checked: a contiguous `[batch, rows, heads, head_dim]` tensor of `T`.
    fn rows<T: CudaElement>(name: TensorName, raw: &RawTensor) -> Result<Checked> {
        let c = raw.check4::<T>(name)?;
        c.expect_contiguous(c.dims())?;
        Ok(c)
    }

    /// The rows of a piece within a rank's rows: `(first local row, count)` per piece, the
    /// pieces of `rank_pieces` in order.
    fn local_runs(problem: &RingProblem, rank: usize) -> Vec<(usize, usize)> {
        let mut at = 0;
        rank_pieces(problem, rank)
            .into_iter()
            .map(|r| {
                let run = (at, r.len());
                at += r.len();
                run
            })
            .collect()
    }

    /// Copy rows `from..from + n` of every batch of `src` (`src_rows` rows a batch) to rows
    /// `to..to + n` of `dst` (`dst_rows` rows a batch), `width` values a row, on `dev`'s stream.
    fn copy_runs<V: cudarc::driver::DeviceRepr>(
        dev: &CudaDevice,
        (batch, width): (usize, usize),
        (src, src_rows, from): (&cudarc::driver::CudaSlice<V>, usize, usize),
        (dst, dst_rows, to): (&mut cudarc::driver::CudaSlice<V>, usize, usize),
        n: usize,
    ) -> Result<()> {
        for (s, d) in run_spans((batch, width), (src_rows, from), (dst_rows, to), n) {
            let mut view = dst.slice_mut(d);
            dev.stream().memcpy_dtod(&src.slice(s), &mut view).map_err(cuda_err)?;
        }
        Ok(())
    }

    /// The pieces of a rank's rows (`c`, a contiguous tensor of this device) as the
    /// compute's buffers (device copies, ordered on its stream).
    fn split<T: CudaElement>(
        x: &CudaChunks,
        name: TensorName,
        c: &Checked,
        runs: &[(usize, usize)],
    ) -> Result<Vec<Rows<T>>> {
        let (span, shape, _) = c.device_parts4()?;
        // SAFETY: a checked, contiguous tensor of `T` on this device (checked by
        // `foreign_slice`) that the Python wrapper holds for the whole call; it is only
        // read, on the call's stream.
        let src = unsafe { foreign_slice::<T>(&x.dev, name, span.0, span.1) }?;
        let width = shape.heads * shape.head_dim;
        runs.iter()
            .map(|&(at, n)| {
                let piece = Shape4::new(shape.batch, n, shape.heads, shape.head_dim)?;
                let mut t = DeviceTensor::<T>::zeros(&x.dev, piece)?;
                copy_runs(&x.dev, (shape.batch, width), (&*src, shape.seq, at), (&mut t.data, n, 0), n)?;
                Ok(x.adopt(t))
            })
            .collect()
    }

    /// Copy each piece's values (`width` a row) into its rows of the caller's contiguous
    /// tensor `c` of `V` (`rows` rows a batch).
    fn join_into<V: cudarc::driver::DeviceRepr>(
        dev: &CudaDevice,
        name: TensorName,
        c: &Checked,
        (batch, rows, width): (usize, usize, usize),
        pieces: &[&cudarc::driver::CudaSlice<V>],
        runs: &[(usize, usize)],
    ) -> Result<()> {
        let (at, len) = c.device_span();
        if len != batch * rows * width || pieces.len() != runs.len() {
            return Err(AttnError::InvalidArgument(format!(
                "{name}: {len} values for {batch} x {rows} rows of {width}, or {} pieces for {} runs",
                pieces.len(),
                runs.len()
            )));
        }
        // SAFETY: a checked, contiguous tensor the Python wrapper allocated for this result
        // and holds for the call; written only here, on the call's stream.
        let mut dst = unsafe { foreign_slice::<V>(dev, name, at, len) }?;
        for (piece, &(to, n)) in pieces.iter().zip(runs) {
            if piece.len() != batch * n * width {
                return Err(AttnError::InvalidArgument(format!(
                    "{name}: a piece of {} values for {n} rows",
                    piece.len()
                )));
            }
            copy_runs(dev, (batch, width), (piece, n, 0), (&mut *dst, rows, to), n)?;
        }
        Ok(())
    }

    /// The device memory of each piece.
    fn data_of<T: CudaElement>(xs: &[Rows<T>]) -> Vec<&cudarc::driver::CudaSlice<T>> {
        xs.iter().map(|r| &r.data).collect()
    }

    /// A call's compute on the link's device, queued on `stream`, its global problem and
    /// the rank's pieces as `(first local row, rows)`.
    struct Prepared {
        x: CudaChunks,
        problem: RingProblem,
        runs: Vec<(usize, usize)>,
    }

    /// The compute on the call's stream and the problem built through the setup's
    /// `problem` (the sequence length agreed over `control`).
    fn prepare(
        (setup, slot, cfg, stream): (&RingSetup, &NcclLinkSlot, &DilatedConfig, usize),
        control: &mut GroupedComm<TorchP2p>,
        (q, k): (Shape4, Shape4),
        masks: attn_core::OwnedMasks,
    ) -> Result<Prepared> {
        let x = CudaChunks::new(on_stream(Placement { device: slot.device, stream })?);
        let problem = setup.problem(control, cfg, q, k, masks)?;
        let runs = local_runs(&problem, setup.rank);
        Ok(Prepared { x, problem, runs })
    }

    /// `call` with the slot's link lent over `control`, given back whatever happens.
    fn with_link<T: CudaElement, R>(
        setup: &RingSetup,
        slot: &NcclLinkSlot,
        control: GroupedComm<TorchP2p>,
        call: impl FnOnce(&mut Transport<T>) -> Result<R>,
    ) -> Result<R> {
        let mut t = slot.lend::<T>(setup, control)?;
        let got = call(&mut t);
        slot.give_back(t);
        got
    }

    pub fn forward<T: CudaElement>(
        py: Python<'_>,
        call: CudaCall<'_>,
        args: &ForwardArgs,
        mask_args: &MaskArgs,
    ) -> Result<()> {
        let [q, k, v, out] = [
            (TensorName::Query, &args.q),
            (TensorName::Key, &args.k),
            (TensorName::Value, &args.v),
            (TensorName::Output, &args.out),
        ]
        .map(|(n, raw)| rows::<T>(n, raw));
        let (q, k, v, out) = (q?, k?, v?, out?);
        args.lse.expect_dtype(TensorName::Lse, "float32")?;
        let lse = args.lse.check(TensorName::Lse, 3, 4, 4)?;
        use Access::{Read, Write};
        check_disjoint(&[(&q, Read), (&k, Read), (&v, Read), (&out, Write), (&lse, Write)])?;
        out.expect_contiguous(q.dims())?;
        lse.expect_contiguous(&q.dims()[..3])?;
        let owned = read_masks(mask_args, &[])?;
        let (qs, ks) = (q.device_parts4()?.1, k.device_parts4()?.1);
        let mut control = call.setup.comm(call.transport)?;
        let CudaCall { setup, slot, cfg, stream, .. } = call;
        py.detach(move || {
            let Prepared { x, problem, runs } = prepare((setup, slot, cfg, stream), &mut control, (qs, ks), owned)?;
            let [qr, kr, vr] = [(TensorName::Query, &q), (TensorName::Key, &k), (TensorName::Value, &v)]
                .map(|(n, c)| split::<T>(&x, n, c, &runs));
            let (qr, kr, vr) = (qr?, kr?, vr?);
            let f = with_link::<T, _>(setup, slot, control, |t| {
                chunk_forward(t, &x, &problem, ChunkOptions::default(), [&qr, &kr, &vr])
            })?;
            let (b, n, h) = (qs.batch, qs.seq, qs.heads);
            let outs: Vec<_> = f.out.iter().map(|r| &r.data).collect();
            join_into(&x.dev, TensorName::Output, &out, (b, n, h * qs.head_dim), &outs, &runs)?;
            let lses: Vec<_> = f.lse.iter().map(|s| &s.data).collect();
            join_into(&x.dev, TensorName::Lse, &lse, (b, n, h), &lses, &runs)?;
            <CudaChunks as ChunkCompute<T>>::sync(&x)
        })
    }

    pub fn backward<T: CudaElement>(
        py: Python<'_>,
        call: CudaCall<'_>,
        args: &RowsBackward,
        mask_args: &MaskArgs,
    ) -> Result<()> {
        let named = [
            (TensorName::Query, &args.q),
            (TensorName::Key, &args.k),
            (TensorName::Value, &args.v),
            (TensorName::GradOutput, &args.grad_out),
            (TensorName::GradQuery, &args.dq),
            (TensorName::GradKey, &args.dk),
            (TensorName::GradValue, &args.dv),
        ]
        .map(|(n, r)| rows::<T>(n, r));
        let [q, k, v, go, dq, dk, dv] = named;
        let (q, k, v, go, dq, dk, dv) = (q?, k?, v?, go?, dq?, dk?, dv?);
        use Access::{Read, Write};
        check_disjoint(&[(&q, Read), (&k, Read), (&v, Read), (&go, Read), (&dq, Write), (&dk, Write), (&dv, Write)])?;
        let (qs, ks) = (q.device_parts4()?.1, k.device_parts4()?.1);
        for (name, c, want) in [
            (TensorName::GradOutput, &go, qs),
            (TensorName::GradQuery, &dq, qs),
            (TensorName::GradKey, &dk, ks),
            (TensorName::GradValue, &dv, ks),
        ] {
            c.expect_contiguous(&[want.batch, want.seq, want.heads, want.head_dim])
                .map_err(|e| AttnError::InvalidArgument(format!("{name}: {e}")))?;
        }
        // The LSE's gradient comes as a host float32 tensor (the ring takes it from the host).
        let grad_lse: Option<Vec<f32>> = match &args.grad_lse {
            None => None,
            Some(raw) => {
                raw.expect_dtype(TensorName::GradLse, "float32")?;
                let c = raw.check(TensorName::GradLse, 3, 4, 4)?;
                Some(c.contiguous_f32(&[qs.batch, qs.seq, qs.heads])?.to_vec())
            }
        };
        let owned = read_masks(mask_args, &[])?;
        let mut control = call.setup.comm(call.transport)?;
        let CudaCall { setup, slot, cfg, stream, .. } = call;
        py.detach(move || {
            let Prepared { x, problem, runs } = prepare((setup, slot, cfg, stream), &mut control, (qs, ks), owned)?;
            let [qr, kr, vr, gr] = [
                (TensorName::Query, &q),
                (TensorName::Key, &k),
                (TensorName::Value, &v),
                (TensorName::GradOutput, &go),
            ]
            .map(|(n, c)| split::<T>(&x, n, c, &runs));
            let (qr, kr, vr, gr) = (qr?, kr?, vr?, gr?);
            let gl = match &grad_lse {
                None => None,
                Some(all) => Some(
                    runs.iter()
                        .zip(&qr)
                        .map(|(&(at, n), qp)| {
                            let (rows, h) = (qs.seq, qs.heads);
                            let vals: Vec<f32> = (0..qs.batch)
                                .flat_map(|b| all[(b * rows + at) * h..(b * rows + at + n) * h].iter().copied())
                                .collect();
                            <CudaChunks as ChunkCompute<T>>::stats_from_bsh(&x, qp.shape, &vals)
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
            };
            let g = with_link::<T, _>(setup, slot, control, |t| {
                chunk_backward(t, &x, &problem, ChunkOptions::default(), [&qr, &kr, &vr], &gr, gl.as_deref())
            })?;
            let qw = (qs.batch, qs.seq, qs.heads * qs.head_dim);
            let kw = (ks.batch, ks.seq, ks.heads * ks.head_dim);
            join_into(&x.dev, TensorName::GradQuery, &dq, qw, &data_of(&g.dq), &runs)?;
            join_into(&x.dev, TensorName::GradKey, &dk, kw, &data_of(&g.dk), &runs)?;
            join_into(&x.dev, TensorName::GradValue, &dv, kw, &data_of(&g.dv), &runs)?;
            <CudaChunks as ChunkCompute<T>>::sync(&x)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_serves_only_its_own_rank_and_world() {
        let setup = RingSetup {
            rank: 1,
            world: 2,
            layout: attn_ring::Layout::Contiguous,
            strategy: attn_ring::Strategy::Ring,
            timeout: Duration::from_secs(1),
            threads: 1,
        };
        assert!(check_slot(&setup, 1, 2).is_ok());
        let err = check_slot(&setup, 0, 2).unwrap_err();
        assert!(err.to_string().contains("rank 0 of 2 cannot serve rank 1 of 2"), "{err}");
    }

    /// The spans that split a rank's rows into its pieces and join them back, applied on
    /// the host: a zigzag rank's two pieces of a batch-3 tensor come out as the rows of
    /// each range and go back to where they were.
    #[test]
    fn pieces_split_and_join_a_ranks_rows_exactly() {
        let (batch, rows, width) = (3, 7, 2);
        let whole: Vec<u32> = (0..batch * rows * width).map(|i| i as u32).collect();
        let runs = [(0, 3), (3, 4)];
        let mut back = vec![u32::MAX; whole.len()];
        for &(at, n) in &runs {
            let mut piece = vec![0; batch * n * width];
            for (s, d) in run_spans((batch, width), (rows, at), (n, 0), n) {
                piece[d].copy_from_slice(&whole[s]);
            }
            for b in 0..batch {
                let want: Vec<u32> =
                    (at..at + n).flat_map(|r| (0..width).map(move |c| ((b * rows + r) * width + c) as u32)).collect();
                assert_eq!(piece[b * n * width..(b + 1) * n * width], want[..], "piece at {at}, batch {b}");
            }
            for (s, d) in run_spans((batch, width), (n, 0), (rows, at), n) {
                back[d].copy_from_slice(&piece[s]);
            }
        }
        assert_eq!(back, whole);
        assert!(run_spans((batch, width), (rows, 0), (rows, 0), 0).is_empty());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_the_reason_names_the_fix() {
        let reason = unavailable_reason(0).expect("a build without `cuda` has no CUDA ring");
        assert!(reason.contains("enable the `cuda` feature"), "{reason}");
        assert!(reason.contains("maturin build --features cuda"), "{reason}");
        assert!(unique_id().is_err());
        assert!(NcclLinkSlot::join(0, 1, 0, &[0; 128], Duration::from_secs(1)).is_err());
    }
}
