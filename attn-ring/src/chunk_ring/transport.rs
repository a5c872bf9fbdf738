//! How the chunk ring moves rows: [`ChunkTransport`] shifts one step's travelling
//! buffers to the next rank; [`HostTransport`] stages them as bytes through any
//! [`Communicator`] (framed, checksummed, with its timeouts).

use attn_core::{AttnError, Element, Result, Shape4};

use super::{ChunkCompute, piece_shapes};
use crate::comm::Communicator;
use crate::plan::RingProblem;
use crate::protocol::wire::{Expected, MsgKind, Reader, begin};

/// What a rank sends at one step: the pieces of `owner`'s k/v rows and/or their dk/dv
/// accumulators (empty slices: not sent). `step` counts from 1 within a pass.
#[derive(Debug)]
pub struct Travel<'a, R, A> {
    pub owner: usize,
    pub step: usize,
    pub k: &'a [R],
    pub v: &'a [R],
    pub dk: &'a [A],
    pub dv: &'a [A],
}

/// What arrives from the previous rank at the same step: its travel (owner one rank back).
#[derive(Debug)]
pub struct Arrived<R, A> {
    pub k: Vec<R>,
    pub v: Vec<R>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
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
        travel: &Travel<'_, X::Rows, X::Acc>,
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

/// The message kind of a travel: k/v alone, k/v with their gradients, or gradients going home.
pub(crate) fn kind_of<R, A>(t: &Travel<'_, R, A>, rank: usize) -> Result<MsgKind> {
    match (t.k.is_empty(), t.dk.is_empty()) {
        (false, true) => Ok(MsgKind::ChunkKv),
        (false, false) => Ok(MsgKind::ChunkKvGrad),
        (true, false) => Ok(MsgKind::ChunkGradHome),
        (true, true) => Err(AttnError::Comm { rank, message: "a chunk ring step with nothing to send".into() }),
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
        problem: &RingProblem,
        travel: &Travel<'_, X::Rows, X::Acc>,
    ) -> Result<Arrived<X::Rows, X::Acc>> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let kind = kind_of(travel, rank)?;
        let mut msg = begin(kind, travel.owner, travel.step, 0);
        for r in travel.k.iter().chain(travel.v) {
            compute.rows_to_bytes(r, &mut msg)?;
        }
        for a in travel.dk.iter().chain(travel.dv) {
            compute.acc_to_bytes(a, &mut msg)?;
        }
        let (next, prev) = (self.comm.next(), self.comm.prev());
        let got = self.comm.sendrecv(next, msg, prev)?;
        let owner = (travel.owner + world - 1) % world;
        let mut rd = Reader::open(&got, Expected { kind, owner, step: travel.step, rank })?;
        let shapes = piece_shapes(problem, owner, problem.kv_heads)?;
        let mut arrived = Arrived { k: Vec::new(), v: Vec::new(), dk: Vec::new(), dv: Vec::new() };
        let size = T::DTYPE.size();
        let rows = |rd: &mut Reader<'_>, s: &Shape4| compute.rows_from_bytes(*s, rd.bytes(s.numel() * size)?);
        let accs = |rd: &mut Reader<'_>, s: &Shape4| compute.acc_from_bytes(*s, rd.bytes(s.numel() * 4)?);
        if !travel.k.is_empty() {
            arrived.k = shapes.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
            arrived.v = shapes.iter().map(|s| rows(&mut rd, s)).collect::<Result<_>>()?;
        }
        if !travel.dk.is_empty() {
            arrived.dk = shapes.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
            arrived.dv = shapes.iter().map(|s| accs(&mut rd, s)).collect::<Result<_>>()?;
        }
        rd.finish()?;
        Ok(arrived)
    }
}
