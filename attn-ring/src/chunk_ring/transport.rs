//! How the chunk ring moves rows: [`ChunkTransport`] shifts one step's travelling
//! buffers [`Travel::hop`] ranks on (the next rank, or straight home); [`HostTransport`]
//! stages them as bytes through any [`Communicator`] (framed, checksummed, with its
//! timeouts). The head strategies' all-to-all within a group of ranks
//! ([`ChunkTransport::all_to_all`]) hands each member one [`Parcel`].

use std::sync::Arc;

use attn_core::{AttnError, Element, Result, Shape4};

use super::{ChunkCompute, whole_heads_only};
use crate::comm::{CommStats, Communicator};
use crate::plan::RingProblem;
use crate::protocol::wire::{Expected, MsgKind, Reader, begin};

/// What a step's message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TravelKind {
    /// k/v rows.
    Kv,
    /// k/v rows with their dk/dv accumulators.
    KvGrad,
    /// dk/dv accumulators going home to their owner.
    GradHome,
}

impl TravelKind {
    pub(crate) fn msg_kind(self) -> MsgKind {
        match self {
            TravelKind::Kv => MsgKind::ChunkKv,
            TravelKind::KvGrad => MsgKind::ChunkKvGrad,
            TravelKind::GradHome => MsgKind::ChunkGradHome,
        }
    }

    /// Whether the message carries k/v rows.
    pub fn has_rows(self) -> bool {
        self != TravelKind::GradHome
    }

    /// Whether the message carries dk/dv accumulators.
    pub fn has_grads(self) -> bool {
        self != TravelKind::Kv
    }
}

/// What a rank sends at one step, handed over to the transport: slices of `owner`'s k/v
/// rows (shared: the rank may still compute with them while they move) and/or their dk/dv
/// accumulators, as `kind` says (a round can hold no rows of a rank: every vector empty).
/// Every rank sends to the rank `hop` after it and receives from the rank `hop` before
/// it (`1..world`: 1 is the next rank). `step` counts from 1 within a pass. `arriving`
/// are the shapes of the slices the sending rank sends at the same step (for its k/v and
/// dk/dv alike).
#[derive(Debug)]
pub struct Travel<R, A> {
    pub kind: TravelKind,
    pub owner: usize,
    pub hop: usize,
    pub step: usize,
    pub k: Vec<Arc<R>>,
    pub v: Vec<Arc<R>>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
    pub arriving: Vec<Shape4>,
}

/// Which all-to-all of the head strategies a parcel belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exchange {
    /// q, k, v (and the backward's grad_out and gradient into the LSE) of the receiver's heads.
    HeadsIn,
    /// Out and lse of the receiver's rows.
    HeadsOut,
    /// dq, dk and dv of the receiver's rows.
    GradsOut,
}

impl Exchange {
    pub(crate) fn msg_kind(self) -> MsgKind {
        match self {
            Exchange::HeadsIn => MsgKind::HeadsIn,
            Exchange::HeadsOut => MsgKind::HeadsOut,
            Exchange::GradsOut => MsgKind::HeadsGradOut,
        }
    }
}

/// What one member of an all-to-all hands another: rows in `T` and f32 accumulators (per-row
/// values travel as accumulators of head_dim 1).
#[derive(Debug)]
pub struct Parcel<R, A> {
    pub rows: Vec<Arc<R>>,
    pub accs: Vec<A>,
}

/// The shapes a parcel from one member must have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParcelShapes {
    pub rows: Vec<Shape4>,
    pub accs: Vec<Shape4>,
}

/// The bytes after the header of a host-staged message carrying `rows` (in `T`) and `accs`
/// (in f32): what a host-staged transport sends and an in-process one counts.
pub(crate) fn payload_bytes<'a, T: Element, X: ChunkCompute<T>>(
    compute: &X,
    rows: impl IntoIterator<Item = &'a X::Rows>,
    accs: impl IntoIterator<Item = &'a X::Acc>,
) -> usize
where
    X::Rows: 'a,
    X::Acc: 'a,
{
    let size = T::DTYPE.size();
    let rows: usize = rows.into_iter().map(|r| compute.shape_of(r).numel() * size).sum();
    rows + accs.into_iter().map(|a| compute.acc_bytes(a)).sum::<usize>()
}

/// Check an all-to-all's arguments: one parcel and one expectation per member, this rank
/// among them.
pub(crate) fn check_members(rank: usize, members: &[usize], parcels: usize, expect: usize) -> Result<usize> {
    let me = members.iter().position(|&m| m == rank);
    match me {
        Some(i) if parcels == members.len() && expect == members.len() => Ok(i),
        _ => Err(AttnError::InvalidArgument(format!(
            "rank {rank}: an all-to-all over members {members:?} with {parcels} parcels and {expect} expectations"
        ))),
    }
}

/// What arrives from the rank `hop` back at the same step: its travel (owner `hop` ranks
/// back).
#[derive(Debug)]
pub struct Arrived<R, A> {
    pub k: Vec<Arc<R>>,
    pub v: Vec<Arc<R>>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
}

impl<R, A> Arrived<R, A> {
    fn empty() -> Self {
        Arrived { k: Vec::new(), v: Vec::new(), dk: Vec::new(), dv: Vec::new() }
    }
}

/// What a started shift must check on arrival: (kind, owner and step the sending rank
/// sends, the arriving shapes), and the two peers.
#[derive(Debug, Clone)]
pub(crate) struct Awaited {
    pub kind: TravelKind,
    pub owner: usize,
    pub step: usize,
    pub arriving: Vec<Shape4>,
    /// The rank this one sends to.
    pub to: usize,
    /// The rank this one receives from.
    pub from: usize,
}

impl Awaited {
    /// What rank `rank` receives at the step of its `travel` on a ring of `world`: the
    /// travel of the rank `hop` back; a hop outside `1..world` is an error (a single rank
    /// may send itself a hop of 1).
    pub(crate) fn of<R, A>(travel: &Travel<R, A>, rank: usize, world: usize) -> Result<Self> {
        let hop = travel.hop;
        if hop == 0 || hop >= world.max(2) {
            let message = format!("a travel of {hop} ranks on a ring of {world}");
            return Err(AttnError::Comm { rank, message });
        }
        Ok(Awaited {
            kind: travel.kind,
            owner: (travel.owner + world - hop) % world,
            step: travel.step,
            arriving: travel.arriving.clone(),
            to: (rank + hop) % world,
            from: (rank + world - hop) % world,
        })
    }
}

/// The error for a second shift started before the first has finished, or a finish
/// without a start.
pub(crate) fn out_of_order(rank: usize, what: &str) -> AttnError {
    AttnError::Comm { rank, message: format!("chunk ring transport: {what}") }
}

/// A travel's vectors against its kind: rows iff the kind has rows, as many k as v, dk as dv.
pub(crate) fn check_travel<R, A>(t: &Travel<R, A>, rank: usize) -> Result<()> {
    let rows_ok = t.k.len() == t.v.len() && (t.kind.has_rows() || t.k.is_empty());
    let grads_ok = t.dk.len() == t.dv.len() && (t.kind.has_grads() || t.dk.is_empty());
    if rows_ok && grads_ok {
        return Ok(());
    }
    let message = format!(
        "a {:?} travel with {} k, {} v, {} dk and {} dv slices",
        t.kind,
        t.k.len(),
        t.v.len(),
        t.dk.len(),
        t.dv.len()
    );
    Err(AttnError::Comm { rank, message })
}

/// How a chunk ring moves a step's buffers: every rank sends its travel [`Travel::hop`]
/// ranks on and receives the travel of the rank as far back, all ranks at the same step
/// with the same kind and hop. A
/// shift is started and then finished; between the two the rank computes with the k/v it
/// is sending, which a transport that can overlap moves meanwhile. One shift is in
/// flight at a time.
pub trait ChunkTransport<T: Element, X: ChunkCompute<T>> {
    /// The communicator of the handshake and the completion rounds.
    type Control: Communicator + ?Sized;
    /// The control communicator.
    fn control(&mut self) -> &mut Self::Control;
    /// Start sending `travel` `travel.hop` ranks on and receiving the travel of the rank
    /// as far back.
    fn start(&mut self, compute: &X, problem: &RingProblem, travel: Travel<X::Rows, X::Acc>) -> Result<()>;
    /// Finish the started shift: what the sending rank sent.
    fn finish(&mut self, compute: &X, problem: &RingProblem) -> Result<Arrived<X::Rows, X::Acc>>;
    /// The all-to-all of the head strategies within `members` (every member calls it with
    /// the same list, this rank among them): `parcels[i]` goes to `members[i]`, and the
    /// parcel each member sends this rank comes back in `members` order, checked against
    /// `expect[i]` (this rank's own parcel is handed back without travelling). A transport
    /// without one refuses the head strategies with a typed error.
    fn all_to_all(
        &mut self,
        _compute: &X,
        _kind: Exchange,
        _members: &[usize],
        _parcels: Vec<Parcel<X::Rows, X::Acc>>,
        _expect: &[ParcelShapes],
    ) -> Result<Vec<Parcel<X::Rows, X::Acc>>> {
        Err(whole_heads_only("chunk ring transport"))
    }
    /// What this transport has moved itself, beside its control communicator (whose own
    /// statistics count what travels through it), since it was made: payload bytes (message
    /// headers included) and messages as a host-staged transport sends them. Zero where
    /// every byte goes through the control communicator.
    fn moved(&self) -> CommStats {
        CommStats::default()
    }
    /// Start and finish a shift.
    fn shift(
        &mut self,
        compute: &X,
        problem: &RingProblem,
        travel: Travel<X::Rows, X::Acc>,
    ) -> Result<Arrived<X::Rows, X::Acc>> {
        self.start(compute, problem, travel)?;
        self.finish(compute, problem)
    }
}

/// Host-staged transport: a step's buffers as one data message (header with kind, owner
/// and step, checked on receipt) over the communicator's paired exchange. `start` stages
/// the message; `finish` exchanges it (a paired exchange cannot deadlock where separate
/// blocking sends could).
#[derive(Debug)]
pub struct HostTransport<'c, C: Communicator + ?Sized> {
    comm: &'c mut C,
    staged: Option<(Vec<u8>, Awaited)>,
}

impl<'c, C: Communicator + ?Sized> HostTransport<'c, C> {
    pub fn new(comm: &'c mut C) -> Self {
        HostTransport { comm, staged: None }
    }
}

impl<T: Element, X: ChunkCompute<T>, C: Communicator + ?Sized> ChunkTransport<T, X> for HostTransport<'_, C> {
    type Control = C;

    fn control(&mut self) -> &mut C {
        self.comm
    }

    fn start(&mut self, compute: &X, _problem: &RingProblem, travel: Travel<X::Rows, X::Acc>) -> Result<()> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        check_travel(&travel, rank)?;
        if self.staged.is_some() {
            return Err(out_of_order(rank, "a shift started while another is in flight"));
        }
        let size = payload_bytes::<T, X>(
            compute,
            travel.k.iter().chain(&travel.v).map(|r| &**r),
            travel.dk.iter().chain(&travel.dv),
        );
        let mut msg = begin(travel.kind.msg_kind(), travel.owner, travel.step, size);
        for r in travel.k.iter().chain(&travel.v) {
            compute.rows_to_bytes(r, &mut msg)?;
        }
        for a in travel.dk.iter().chain(&travel.dv) {
            compute.acc_to_bytes(a, &mut msg)?;
        }
        self.staged = Some((msg, Awaited::of(&travel, rank, world)?));
        Ok(())
    }

    fn finish(&mut self, compute: &X, _problem: &RingProblem) -> Result<Arrived<X::Rows, X::Acc>> {
        let rank = self.comm.rank();
        let (msg, want) = self.staged.take().ok_or_else(|| out_of_order(rank, "a finish with no shift started"))?;
        let got = self.comm.sendrecv(want.to, msg, want.from)?;
        let kind = want.kind.msg_kind();
        let mut rd = Reader::open(&got, Expected { kind, owner: want.owner, step: want.step, rank })?;
        let mut arrived = Arrived::empty();
        let size = T::DTYPE.size();
        let rows =
            |rd: &mut Reader<'_>, s: &Shape4| compute.rows_from_bytes(*s, rd.bytes(s.numel() * size)?).map(Arc::new);
        let accs = |rd: &mut Reader<'_>, s: &Shape4| compute.acc_from_bytes(*s, rd.bytes(s.numel() * 4)?);
        if want.kind.has_rows() {
            arrived.k = want.arriving.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
            arrived.v = want.arriving.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
        }
        if want.kind.has_grads() {
            arrived.dk = want.arriving.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
            arrived.dv = want.arriving.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
        }
        rd.finish()?;
        Ok(arrived)
    }

    fn all_to_all(
        &mut self,
        compute: &X,
        kind: Exchange,
        members: &[usize],
        parcels: Vec<Parcel<X::Rows, X::Acc>>,
        expect: &[ParcelShapes],
    ) -> Result<Vec<Parcel<X::Rows, X::Acc>>> {
        let rank = self.comm.rank();
        check_members(rank, members, parcels.len(), expect.len())?;
        let size = T::DTYPE.size();
        let mut payloads = Vec::with_capacity(parcels.len());
        for p in &parcels {
            // Sized once for the rows and the f32 accumulators: filling it never reallocates.
            let bytes = payload_bytes::<T, X>(compute, p.rows.iter().map(|r| &**r), &p.accs);
            let mut msg = begin(kind.msg_kind(), rank, 0, bytes);
            for r in &p.rows {
                compute.rows_to_bytes(r, &mut msg)?;
            }
            for a in &p.accs {
                compute.acc_to_bytes(a, &mut msg)?;
            }
            payloads.push(msg);
        }
        drop(parcels);
        let got = crate::comm::all_to_all::all_to_all(self.comm, members, payloads)?;
        got.iter()
            .zip(members.iter().zip(expect))
            .map(|(bytes, (&owner, want))| {
                let mut rd = Reader::open(bytes, Expected { kind: kind.msg_kind(), owner, step: 0, rank })?;
                let rows = want
                    .rows
                    .iter()
                    .map(|s| compute.rows_from_bytes(*s, rd.bytes(s.numel() * size)?).map(Arc::new))
                    .collect::<Result<_>>()?;
                let accs = want
                    .accs
                    .iter()
                    .map(|s| compute.acc_from_bytes(*s, rd.bytes(s.numel() * 4)?))
                    .collect::<Result<_>>()?;
                rd.finish()?;
                Ok(Parcel { rows, accs })
            })
            .collect()
    }
}
