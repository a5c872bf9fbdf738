//! How the chunk ring moves rows: [`ChunkTransport`] shifts one step's travelling
//! buffers to the next rank; [`HostTransport`] stages them as bytes through any
//! [`Communicator`] (framed, checksummed, with its timeouts).

use attn_core::{AttnError, Element, Result, Shape4};

use super::ChunkCompute;
use crate::comm::Communicator;
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
/// rows and/or their dk/dv accumulators, as `kind` says (a round can hold no rows of a
/// rank: every vector empty). `step` counts from 1 within a pass. `arriving` are the
/// shapes of the slices the previous rank sends at the same step (for its k/v and dk/dv
/// alike).
#[derive(Debug)]
pub struct Travel<R, A> {
    pub kind: TravelKind,
    pub owner: usize,
    pub step: usize,
    pub k: Vec<R>,
    pub v: Vec<R>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
    pub arriving: Vec<Shape4>,
}

/// What arrives from the previous rank at the same step: its travel (owner one rank back).
#[derive(Debug)]
pub struct Arrived<R, A> {
    pub k: Vec<R>,
    pub v: Vec<R>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
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

/// How a chunk ring moves a step's buffers: every rank sends its travel to the next rank
/// and receives the previous rank's, all ranks at the same step with the same kind.
pub trait ChunkTransport<T: Element, X: ChunkCompute<T>> {
    /// The communicator of the handshake and the completion rounds.
    type Control: Communicator + ?Sized;
    /// The control communicator.
    fn control(&mut self) -> &mut Self::Control;
    /// Send `travel` to the next rank; return what the previous rank sent.
    fn shift(
        &mut self,
        compute: &X,
        problem: &RingProblem,
        travel: Travel<X::Rows, X::Acc>,
    ) -> Result<Arrived<X::Rows, X::Acc>>;
}

/// Host-staged transport: a step's buffers as one data message (header with kind, owner
/// and step, checked on receipt) over the communicator's paired exchange.
#[derive(Debug)]
pub struct HostTransport<'c, C: Communicator + ?Sized> {
    comm: &'c mut C,
}

impl<'c, C: Communicator + ?Sized> HostTransport<'c, C> {
    pub fn new(comm: &'c mut C) -> Self {
        HostTransport { comm }
    }
}

impl<T: Element, X: ChunkCompute<T>, C: Communicator + ?Sized> ChunkTransport<T, X> for HostTransport<'_, C> {
    type Control = C;

    fn control(&mut self) -> &mut C {
        self.comm
    }

    fn shift(
        &mut self,
        compute: &X,
        _problem: &RingProblem,
        travel: Travel<X::Rows, X::Acc>,
    ) -> Result<Arrived<X::Rows, X::Acc>> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        check_travel(&travel, rank)?;
        let kind = travel.kind.msg_kind();
        let mut msg = begin(kind, travel.owner, travel.step, 0);
        for r in travel.k.iter().chain(&travel.v) {
            compute.rows_to_bytes(r, &mut msg)?;
        }
        for a in travel.dk.iter().chain(&travel.dv) {
            compute.acc_to_bytes(a, &mut msg)?;
        }
        drop(travel.k);
        drop(travel.v);
        drop(travel.dk);
        drop(travel.dv);
        let (next, prev) = (self.comm.next(), self.comm.prev());
        let got = self.comm.sendrecv(next, msg, prev)?;
        let owner = (travel.owner + world - 1) % world;
        let mut rd = Reader::open(&got, Expected { kind, owner, step: travel.step, rank })?;
        let mut arrived = Arrived { k: Vec::new(), v: Vec::new(), dk: Vec::new(), dv: Vec::new() };
        let size = T::DTYPE.size();
        let rows = |rd: &mut Reader<'_>, s: &Shape4| compute.rows_from_bytes(*s, rd.bytes(s.numel() * size)?);
        let accs = |rd: &mut Reader<'_>, s: &Shape4| compute.acc_from_bytes(*s, rd.bytes(s.numel() * 4)?);
        if travel.kind.has_rows() {
            arrived.k = travel.arriving.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
            arrived.v = travel.arriving.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
        }
        if travel.kind.has_grads() {
            arrived.dk = travel.arriving.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
            arrived.dv = travel.arriving.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
        }
        rd.finish()?;
        Ok(arrived)
    }
}
