//! [`NcclDeviceTransport`]: the chunk ring's k/v slices and dk/dv accumulators sent and
//! received by NCCL straight from and into the compute's device buffers, on its stream
//! (no host staging). Each step first swaps a small checked header over the control
//! communicator (kind, owner, step and every buffer's byte count), so a rank out of step
//! or a wrong size is a typed error before any NCCL call; the data round itself is
//! `nccl_handle`'s, with its deadline and abort.

use std::sync::Arc;

use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::transport::check_travel;
use super::{Arrived, ChunkCompute, ChunkTransport, Travel};
use crate::comm::nccl_handle::{NcclHandle, bytes_of, bytes_of_mut};
use crate::comm::{Communicator, NcclComm};
use crate::plan::RingProblem;
use crate::protocol::wire::{Expected, Reader, begin};
use attn_kernels::cuda::CudaElement;

/// A chunk compute whose rows and accumulators are device buffers NCCL can read and
/// write: contiguous `T` rows and f32 accumulators, on one stream.
pub trait DeviceBuffers<T: CudaElement>: ChunkCompute<T> {
    /// The stream the compute's work runs on; NCCL's sends and receives are queued there.
    fn stream(&self) -> &Arc<CudaStream>;
    /// The device memory of `rows`.
    fn rows_buffer<'a>(&self, rows: &'a Self::Rows) -> &'a CudaSlice<T>;
    /// The device memory of `rows`, to receive into.
    fn rows_buffer_mut<'a>(&self, rows: &'a mut Self::Rows) -> &'a mut CudaSlice<T>;
    /// The device memory of an accumulator.
    fn acc_buffer<'a>(&self, acc: &'a Self::Acc) -> &'a CudaSlice<f32>;
    /// The device memory of an accumulator, to receive into.
    fn acc_buffer_mut<'a>(&self, acc: &'a mut Self::Acc) -> &'a mut CudaSlice<f32>;
}

/// One rank's end of a chunk ring whose data moves by NCCL between device buffers;
/// `control` carries the handshake, the completion rounds and each step's header.
pub struct NcclDeviceTransport<C> {
    control: C,
    data: NcclHandle,
}

impl<C> std::fmt::Debug for NcclDeviceTransport<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclDeviceTransport").field("data", &self.data).finish_non_exhaustive()
    }
}

impl<C: Communicator> NcclDeviceTransport<C> {
    /// Join an NCCL communicator for the ring's data with the ranks of `control`, this
    /// rank on the device of `ctx` (one device per rank): rank 0 makes the unique id and
    /// sends it over `control`; when it cannot, every rank gets a typed error.
    pub fn bootstrap(mut control: C, ctx: &Arc<CudaContext>) -> Result<Self> {
        let (rank, world) = (control.rank(), control.world_size());
        let made = if rank == 0 { Some(NcclComm::unique_id()) } else { None };
        let offer = match &made {
            Some(Ok(id)) => id.to_vec(),
            _ => Vec::new(),
        };
        let ids = control.all_gather(offer)?;
        if let Some(Err(e)) = made {
            return Err(e);
        }
        let id: [u8; 128] = ids[0].as_slice().try_into().map_err(|_| AttnError::Comm {
            rank,
            message: "rank 0 could not make an NCCL unique id (see its error)".into(),
        })?;
        ctx.bind_to_thread().map_err(|e| AttnError::Comm { rank, message: format!("bind the CUDA context: {e:?}") })?;
        let data = NcclHandle::join(rank, world, &id, control.timeout())?;
        Ok(NcclDeviceTransport { control, data })
    }
}

/// The byte counts of a travel's buffers, in sending order.
fn byte_counts(kind_rows: bool, kind_grads: bool, shapes: &[Shape4], elem: usize) -> Vec<u64> {
    let mut out = Vec::new();
    if kind_rows {
        out.extend(shapes.iter().chain(shapes).map(|s| (s.numel() * elem) as u64));
    }
    if kind_grads {
        out.extend(shapes.iter().chain(shapes).map(|s| (s.numel() * 4) as u64));
    }
    out
}

impl<T, X, C> ChunkTransport<T, X> for NcclDeviceTransport<C>
where
    T: CudaElement,
    X: DeviceBuffers<T>,
    C: Communicator,
{
    type Control = C;

    fn control(&mut self) -> &mut C {
        &mut self.control
    }

    fn shift(
        &mut self,
        compute: &X,
        _problem: &RingProblem,
        travel: Travel<X::Rows, X::Acc>,
    ) -> Result<Arrived<X::Rows, X::Acc>> {
        let (rank, world) = (self.control.rank(), self.control.world_size());
        check_travel(&travel, rank)?;
        let (has_rows, has_grads) = (travel.kind.has_rows(), travel.kind.has_grads());
        let elem = T::DTYPE.size();
        // The header: what this rank sends, checked by the next rank against what it expects.
        let sent: Vec<u64> = travel
            .k
            .iter()
            .chain(&travel.v)
            .map(|r| (compute.rows_buffer(r).len() * elem) as u64)
            .chain(travel.dk.iter().chain(&travel.dv).map(|a| (compute.acc_buffer(a).len() * 4) as u64))
            .collect();
        let kind = travel.kind.msg_kind();
        let mut header = begin(kind, travel.owner, travel.step, sent.len() * 8);
        sent.iter().for_each(|n| header.extend_from_slice(&n.to_le_bytes()));
        let (next, prev) = (self.control.next(), self.control.prev());
        let got = self.control.sendrecv(next, header, prev)?;
        let owner = (travel.owner + world - 1) % world;
        let mut rd = Reader::open(&got, Expected { kind, owner, step: travel.step, rank })?;
        let want = byte_counts(has_rows, has_grads, &travel.arriving, elem);
        let mut theirs = Vec::with_capacity(want.len());
        for _ in &want {
            let b = rd.bytes(8)?;
            theirs.push(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        }
        rd.finish()?;
        if theirs != want {
            return Err(AttnError::Comm {
                rank,
                message: format!("rank {prev} sends buffers of {theirs:?} bytes, this rank expects {want:?}"),
            });
        }
        let mut arrived = Arrived { k: Vec::new(), v: Vec::new(), dk: Vec::new(), dv: Vec::new() };
        if has_rows {
            arrived.k = travel.arriving.iter().map(|s| compute.zero_rows(*s)).collect::<Result<_>>()?;
            arrived.v = travel.arriving.iter().map(|s| compute.zero_rows(*s)).collect::<Result<_>>()?;
        }
        if has_grads {
            arrived.dk = travel.arriving.iter().map(|s| compute.zero_acc(*s)).collect::<Result<_>>()?;
            arrived.dv = travel.arriving.iter().map(|s| compute.zero_acc(*s)).collect::<Result<_>>()?;
        }
        let unviewable = || AttnError::Comm { rank, message: "a device buffer could not be viewed as bytes".into() };
        {
            let sends = travel
                .k
                .iter()
                .chain(&travel.v)
                .map(|r| bytes_of(compute.rows_buffer(r)))
                .chain(travel.dk.iter().chain(&travel.dv).map(|a| bytes_of(compute.acc_buffer(a))))
                .map(|b| b.map(|b| (next, b)).ok_or_else(unviewable))
                .collect::<Result<Vec<_>>>()?;
            let Arrived { k, v, dk, dv } = &mut arrived;
            let mut recvs = k
                .iter_mut()
                .chain(v.iter_mut())
                .map(|r| bytes_of_mut(compute.rows_buffer_mut(r)))
                .chain(dk.iter_mut().chain(dv.iter_mut()).map(|a| bytes_of_mut(compute.acc_buffer_mut(a))))
                .map(|b| b.map(|b| (prev, b)).ok_or_else(unviewable))
                .collect::<Result<Vec<_>>>()?;
            if !sends.is_empty() || !recvs.is_empty() {
                self.data.round(compute.stream(), &sends, &mut recvs, prev, self.control.timeout())?;
            }
        }
        // The round has completed on the stream: the sent buffers (`travel`) can go.
        Ok(arrived)
    }
}

impl<T: CudaElement> DeviceBuffers<T> for super::CudaChunks {
    fn stream(&self) -> &Arc<CudaStream> {
        self.dev.stream()
    }
    fn rows_buffer<'a>(&self, rows: &'a Self::Rows) -> &'a CudaSlice<T> {
        &rows.data
    }
    fn rows_buffer_mut<'a>(&self, rows: &'a mut Self::Rows) -> &'a mut CudaSlice<T> {
        &mut rows.data
    }
    fn acc_buffer<'a>(&self, acc: &'a Self::Acc) -> &'a CudaSlice<f32> {
        &acc.data
    }
    fn acc_buffer_mut<'a>(&self, acc: &'a mut Self::Acc) -> &'a mut CudaSlice<f32> {
        &mut acc.data
    }
}
