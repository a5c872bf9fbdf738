//! [`NcclDeviceTransport`]: the chunk ring's k/v slices and dk/dv accumulators sent and
//! received by NCCL straight from and into the compute's device buffers, on its stream
//! (no host staging). Each step first swaps a small checked header over the control
//! communicator (kind, owner, step and every buffer's byte count), so a rank out of step
//! or a wrong size is a typed error before any NCCL call; the data round itself is
//! `nccl_handle`'s, with its deadline and abort, posted on an NCCL stream of the
//! transport's own when the shift starts and awaited when it finishes, so the rank's
//! blocks run meanwhile. The head strategies' all-to-all is the same in one step: a
//! header to every member (its parcel's byte counts, checked by the receiver against what
//! it expects) over the control communicator, then every send and receive of the group in
//! one grouped NCCL round (empty buffers skipped on both sides), awaited before the
//! parcels are handed back.

use std::sync::Arc;

use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::transport::{Awaited, check_members, check_travel, out_of_order};
use super::{Arrived, ChunkCompute, ChunkTransport, Exchange, Parcel, ParcelShapes, Travel};
use crate::comm::Communicator;
use crate::comm::all_to_all::all_to_all;
use crate::comm::nccl_comm::{NCCL_ID_BYTES, share_unique_id};
use crate::comm::nccl_handle::{NcclHandle, PostedRound, bytes_of, bytes_of_mut};
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

/// One rank's end of a chunk ring whose data moves by NCCL between device buffers, on
/// an NCCL stream of its own so that a step's blocks run while its slices move;
/// `control` carries the handshake, the completion rounds and each step's header.
pub struct NcclDeviceTransport<C, R, A> {
    /// Declared first: dropped (aborted, cancelling a round in flight) before the buffers
    /// of that round.
    data: NcclHandle,
    in_flight: Option<InFlight<R, A>>,
    control: C,
    stream: Arc<CudaStream>,
}

/// A started shift: its posted round, the buffers it sends and those it receives into.
struct InFlight<R, A> {
    posted: Option<PostedRound>,
    _sent: Travel<R, A>,
    arrived: Arrived<R, A>,
}

impl<C, R, A> std::fmt::Debug for NcclDeviceTransport<C, R, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclDeviceTransport")
            .field("data", &self.data)
            .field("in_flight", &self.in_flight.is_some())
            .finish_non_exhaustive()
    }
}

/// The NCCL communicator and stream of a chunk ring's data, joined once and reusable by
/// later calls over the same ranks ([`NcclDeviceTransport::over`] lends it to one call,
/// [`NcclDeviceTransport::into_link`] returns it): joining costs a rendezvous of every
/// rank, so a caller that runs many calls on one group keeps the link. A link whose
/// communicator a failure aborted refuses every later round ([`NcclDeviceLink::usable`]).
pub struct NcclDeviceLink {
    data: NcclHandle,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for NcclDeviceLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclDeviceLink")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl NcclDeviceLink {
    /// Join the NCCL communicator `id` (made by `NcclComm::unique_id` on one rank and
    /// handed to every rank out of band) as `rank` of `world`, on the device of `ctx`,
    /// waiting at most `timeout` for every rank to join (`Timeout` if one never does).
    pub fn join(
        rank: usize,
        world: usize,
        ctx: &Arc<CudaContext>,
        id: &[u8; NCCL_ID_BYTES],
        timeout: std::time::Duration,
    ) -> Result<Self> {
        let cuda =
            |what: &str, e: cudarc::driver::DriverError| AttnError::Comm { rank, message: format!("{what}: {e:?}") };
        let stream = ctx.new_stream().map_err(|e| cuda("NCCL stream", e))?;
        ctx.bind_to_thread().map_err(|e| cuda("bind the CUDA context", e))?;
        let data = NcclHandle::join(rank, world, id, timeout)?;
        Ok(NcclDeviceLink { data, stream, rank, world })
    }

    /// This rank and the world size the link joined with.
    pub fn place(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    /// Error unless the communicator can still run rounds (a failed or timed-out round
    /// aborts it).
    pub fn usable(&self) -> Result<()> {
        self.data.usable()
    }
}

impl<C: Communicator, R, A> NcclDeviceTransport<C, R, A> {
    /// Join an NCCL communicator for the ring's data with the ranks of `control`, this
    /// rank on the device of `ctx` (one device per rank): rank 0 makes the unique id and
    /// sends it over `control`; when it cannot, every rank gets a typed error.
    pub fn bootstrap(mut control: C, ctx: &Arc<CudaContext>) -> Result<Self> {
        let (rank, world) = (control.rank(), control.world_size());
        let id = share_unique_id(&mut control)?;
        let link = NcclDeviceLink::join(rank, world, ctx, &id, control.timeout())?;
        Self::over(link, control)
    }

    /// A transport whose data moves over `link` and whose handshake, completion rounds
    /// and step headers travel over `control`; the two must name the same rank and world
    /// size (`InvalidArgument` otherwise).
    pub fn over(link: NcclDeviceLink, control: C) -> Result<Self> {
        let here = (control.rank(), control.world_size());
        if link.place() != here {
            return Err(AttnError::InvalidArgument(format!(
                "an NCCL link of rank {} of {} cannot carry the data of rank {} of {}",
                link.rank, link.world, here.0, here.1
            )));
        }
        let NcclDeviceLink { data, stream, .. } = link;
        Ok(NcclDeviceTransport { data, in_flight: None, control, stream })
    }

    /// The link back, for a later call. A shift still in flight (a call that failed
    /// between its start and finish) aborts the communicator first, so its buffers can
    /// drop; the returned link then refuses every round.
    pub fn into_link(self) -> NcclDeviceLink {
        let (rank, world) = (self.control.rank(), self.control.world_size());
        let NcclDeviceTransport { mut data, in_flight, stream, .. } = self;
        if in_flight.is_some() {
            data.abort();
        }
        drop(in_flight);
        NcclDeviceLink { data, stream, rank, world }
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

/// The byte counts of a parcel of `shapes`, in sending order (rows in `T`, then f32 accumulators).
fn parcel_counts(shapes: &ParcelShapes, elem: usize) -> Vec<u64> {
    let rows = shapes.rows.iter().map(|s| (s.numel() * elem) as u64);
    rows.chain(shapes.accs.iter().map(|s| (s.numel() * 4) as u64)).collect()
}

/// The byte counts a received header lists (kind `kind`, from `owner`, for `rank`).
fn header_counts(bytes: &[u8], want: Expected) -> Result<Vec<u64>> {
    let mut rd = Reader::open(bytes, want)?;
    let n = (bytes.len() - rd.position()) / 8;
    let counts = (0..n)
        .map(|_| rd.bytes(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))))
        .collect::<Result<_>>()?;
    rd.finish()?;
    Ok(counts)
}

impl<T, X, C> ChunkTransport<T, X> for NcclDeviceTransport<C, X::Rows, X::Acc>
where
    T: CudaElement,
    X: DeviceBuffers<T>,
    C: Communicator,
{
    type Control = C;

    fn control(&mut self) -> &mut C {
        &mut self.control
    }

    fn start(&mut self, compute: &X, _problem: &RingProblem, travel: Travel<X::Rows, X::Acc>) -> Result<()> {
        let (rank, world) = (self.control.rank(), self.control.world_size());
        check_travel(&travel, rank)?;
        if self.in_flight.is_some() {
            return Err(out_of_order(rank, "a shift started while another is in flight"));
        }
        let want = Awaited::of(&travel, rank, world)?;
        let (has_rows, has_grads) = (want.kind.has_rows(), want.kind.has_grads());
        let elem = T::DTYPE.size();
        // The header: what this rank sends, checked by its receiver against what it expects.
        let sent: Vec<u64> = travel
            .k
            .iter()
            .chain(&travel.v)
            .map(|r| (compute.rows_buffer(r).len() * elem) as u64)
            .chain(travel.dk.iter().chain(&travel.dv).map(|a| (compute.acc_buffer(a).len() * 4) as u64))
            .collect();
        let kind = want.kind.msg_kind();
        let mut header = begin(kind, travel.owner, travel.step, sent.len() * 8);
        sent.iter().for_each(|n| header.extend_from_slice(&n.to_le_bytes()));
        let (to, from) = (want.to, want.from);
        let got = self.control.sendrecv(to, header, from)?;
        let mut rd = Reader::open(&got, Expected { kind, owner: want.owner, step: want.step, rank })?;
        let expected = byte_counts(has_rows, has_grads, &want.arriving, elem);
        let mut theirs = Vec::with_capacity(expected.len());
        for _ in &expected {
            let b = rd.bytes(8)?;
            theirs.push(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        }
        rd.finish()?;
        if theirs != expected {
            return Err(AttnError::Comm {
                rank,
                message: format!("rank {from} sends buffers of {theirs:?} bytes, this rank expects {expected:?}"),
            });
        }
        let rows = |on: bool| -> Result<Vec<X::Rows>> {
            if !on {
                return Ok(Vec::new());
            }
            want.arriving.iter().map(|s| compute.zero_rows(*s)).collect()
        };
        let accs = |on: bool| -> Result<Vec<X::Acc>> {
            if !on {
                return Ok(Vec::new());
            }
            want.arriving.iter().map(|s| compute.zero_acc(*s)).collect()
        };
        let (mut k, mut v, mut dk, mut dv) = (rows(has_rows)?, rows(has_rows)?, accs(has_grads)?, accs(has_grads)?);
        // Sent and received buffers are complete and allocated before NCCL's stream touches them.
        compute.sync()?;
        let unviewable = || AttnError::Comm { rank, message: "a device buffer could not be viewed as bytes".into() };
        let posted = {
            let sends = travel
                .k
                .iter()
                .chain(&travel.v)
                .map(|r| bytes_of(compute.rows_buffer(r)))
                .chain(travel.dk.iter().chain(&travel.dv).map(|a| bytes_of(compute.acc_buffer(a))))
                .map(|b| b.map(|b| (to, b)).ok_or_else(unviewable))
                .collect::<Result<Vec<_>>>()?;
            let mut recvs = k
                .iter_mut()
                .chain(v.iter_mut())
                .map(|r| bytes_of_mut(compute.rows_buffer_mut(r)))
                .chain(dk.iter_mut().chain(dv.iter_mut()).map(|a| bytes_of_mut(compute.acc_buffer_mut(a))))
                .map(|b| b.map(|b| (from, b)).ok_or_else(unviewable))
                .collect::<Result<Vec<_>>>()?;
            if sends.is_empty() && recvs.is_empty() {
                None
            } else {
                Some(self.data.post(&self.stream, &sends, &mut recvs, from, self.control.timeout())?)
            }
        };
        let wrap = |xs: Vec<X::Rows>| xs.into_iter().map(Arc::new).collect();
        let arrived = Arrived { k: wrap(k), v: wrap(v), dk, dv };
        self.in_flight = Some(InFlight { posted, _sent: travel, arrived });
        Ok(())
    }

    fn finish(&mut self, _compute: &X, _problem: &RingProblem) -> Result<Arrived<X::Rows, X::Acc>> {
        let rank = self.control.rank();
        let flight = self.in_flight.take().ok_or_else(|| out_of_order(rank, "a finish with no shift started"))?;
        if let Some(posted) = flight.posted {
            // On failure the communicator is aborted before `flight`'s buffers drop.
            self.data.wait(posted)?;
        }
        Ok(flight.arrived)
    }

    fn all_to_all(
        &mut self,
        compute: &X,
        kind: Exchange,
        members: &[usize],
        parcels: Vec<Parcel<X::Rows, X::Acc>>,
        expect: &[ParcelShapes],
    ) -> Result<Vec<Parcel<X::Rows, X::Acc>>> {
        let rank = self.control.rank();
        let me = check_members(rank, members, parcels.len(), expect.len())?;
        if self.in_flight.is_some() {
            return Err(out_of_order(rank, "an all-to-all while a shift is in flight"));
        }
        let (elem, msg) = (T::DTYPE.size(), kind.msg_kind());
        // The headers: each member learns the byte counts of the buffers this rank sends it.
        let headers = parcels
            .iter()
            .map(|p| {
                let rows = p.rows.iter().map(|r| (compute.rows_buffer(r).len() * elem) as u64);
                let sent: Vec<u64> =
                    rows.chain(p.accs.iter().map(|a| (compute.acc_buffer(a).len() * 4) as u64)).collect();
                let mut h = begin(msg, rank, 0, sent.len() * 8);
                sent.iter().for_each(|n| h.extend_from_slice(&n.to_le_bytes()));
                h
            })
            .collect();
        let got = all_to_all(&mut self.control, members, headers)?;
        for ((bytes, &m), want) in got.iter().zip(members).zip(expect) {
            let theirs = header_counts(bytes, Expected { kind: msg, owner: m, step: 0, rank })?;
            let expected = parcel_counts(want, elem);
            if theirs != expected {
                return Err(AttnError::Comm {
                    rank,
                    message: format!(
                        "rank {m} sends all-to-all buffers of {theirs:?} bytes, this rank expects {expected:?}"
                    ),
                });
            }
        }
        // Every member's buffers, allocated at the agreed sizes (none for this rank's own).
        let mut arrived = Vec::with_capacity(members.len());
        for (i, want) in expect.iter().enumerate() {
            let rows =
                want.rows.iter().filter(|_| i != me).map(|s| compute.zero_rows(*s)).collect::<Result<Vec<_>>>()?;
            let accs =
                want.accs.iter().filter(|_| i != me).map(|s| compute.zero_acc(*s)).collect::<Result<Vec<_>>>()?;
            arrived.push((rows, accs));
        }
        // Sent and received buffers are complete and allocated before NCCL's stream touches them.
        compute.sync()?;
        let unviewable = || AttnError::Comm { rank, message: "a device buffer could not be viewed as bytes".into() };
        {
            let mut sends = Vec::new();
            for (p, &m) in parcels.iter().zip(members).filter(|(_, m)| **m != rank) {
                let rows = p.rows.iter().map(|r| bytes_of(compute.rows_buffer(r)));
                for b in rows.chain(p.accs.iter().map(|a| bytes_of(compute.acc_buffer(a)))) {
                    let b = b.ok_or_else(unviewable)?;
                    if !b.is_empty() {
                        sends.push((m, b));
                    }
                }
            }
            let mut recvs = Vec::new();
            for ((rows, accs), &m) in arrived.iter_mut().zip(members).filter(|(_, m)| **m != rank) {
                let rows = rows.iter_mut().map(|r| bytes_of_mut(compute.rows_buffer_mut(r)));
                for b in rows.chain(accs.iter_mut().map(|a| bytes_of_mut(compute.acc_buffer_mut(a)))) {
                    let b = b.ok_or_else(unviewable)?;
                    if !b.is_empty() {
                        recvs.push((m, b));
                    }
                }
            }
            if !(sends.is_empty() && recvs.is_empty()) {
                // A missed deadline names the next member (which member is silent is unknown here).
                let peer = members[(me + 1) % members.len()];
                // On failure the communicator is aborted before the buffers drop.
                self.data.round(&self.stream, &sends, &mut recvs, peer, self.control.timeout())?;
            }
        }
        let mut own = parcels.into_iter().nth(me);
        arrived
            .into_iter()
            .enumerate()
            .map(|(i, (rows, accs))| match i == me {
                true => own.take().ok_or_else(|| out_of_order(rank, "an all-to-all without its own parcel")),
                false => Ok(Parcel { rows: rows.into_iter().map(Arc::new).collect(), accs }),
            })
            .collect()
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
