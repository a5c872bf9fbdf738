//! The chunk ring's calls: local checks and the handshake, `world` steps in which each
//! rank computes its queries against the k/v pieces it holds and shifts them on, the
//! backward's dk/dv travelling with their k/v and then home, and the completion rounds.

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result};

use super::reach::may_attend;
use super::{ChunkBlock, ChunkCompute, ChunkGrads, ChunkTransport, ChunkUpstream, Travel, piece_shapes, rank_pieces};
use crate::comm::{CommStats, Communicator};
use crate::plan::{Plan, RingProblem};
use crate::protocol::call::{RingStats, finish};
use crate::protocol::handshake::{Refusal, fingerprint, handshake};

/// A rank's forward: output and lse per query piece, and what it sent.
#[derive(Debug)]
pub struct ChunkForward<R, S> {
    pub out: Vec<R>,
    pub lse: Vec<S>,
    pub stats: RingStats,
}

/// A rank's gradients per piece (dq like q, dk and dv like k), and what it sent.
#[derive(Debug)]
pub struct ChunkGradients<R> {
    pub dq: Vec<R>,
    pub dk: Vec<R>,
    pub dv: Vec<R>,
    pub stats: RingStats,
}

/// The first wrong piece count or shape among `tensors` (name, pieces, heads), if any.
fn check_pieces<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    problem: &RingProblem,
    rank: usize,
    tensors: &[(TensorName, &[X::Rows], usize)],
) -> Option<String> {
    for (name, pieces, heads) in tensors {
        let want = match piece_shapes(problem, rank, *heads) {
            Ok(w) => w,
            Err(e) => return Some(format!("{name}: {e}")),
        };
        let got: Vec<_> = pieces.iter().map(|p| compute.shape_of(p).dims()).collect();
        let want: Vec<_> = want.iter().map(|s| s.dims()).collect();
        if got != want {
            return Some(format!("{name} pieces have shapes {got:?}, expected {want:?}"));
        }
    }
    None
}

/// The handshake of a call (every rank the same verdict), after local checks; returns the
/// statistics at the call's start and after the handshake.
fn open_call<T: Element, C: Communicator + ?Sized>(
    comm: &mut C,
    op: &str,
    problem: &RingProblem,
    mut err: Option<String>,
) -> Result<(CommStats, CommStats)> {
    let before = comm.stats();
    let (rank, world) = (comm.rank(), comm.world_size());
    if rank >= world {
        return Err(AttnError::InvalidArgument(format!("communicator has rank {rank} in a world of {world} ranks")));
    }
    if problem.world != world {
        err = Some(format!("problem is for {} ranks but the communicator has {world}", problem.world));
    }
    // The plan validates the problem (config, heads, masks, layout); the same on every rank.
    let valid = if problem.world == world { Plan::new(problem.clone()).map(|_| ()) } else { Ok(()) };
    handshake(comm, &fingerprint(op, problem, T::DTYPE), err.map(Refusal::Inputs))?;
    valid?;
    Ok((before, comm.stats()))
}

/// Whether the block of query piece `q` and key piece `k` (each with its first position)
/// can hold an attended pair.
fn reaches<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    problem: &RingProblem,
    (q, q_start): (&X::Rows, usize),
    (k, k_start): (&X::Rows, usize),
) -> bool {
    let (qn, kn) = (compute.shape_of(q).seq, compute.shape_of(k).seq);
    may_attend(problem, &(q_start..q_start + qn), &(k_start..k_start + kn))
}

/// The k/v pieces received at the last shift (`None`: the rank's own).
type Held<R> = Option<(Vec<R>, Vec<R>)>;

/// The k/v pieces a step computes with: those received at the last shift, or the rank's own.
fn held_or_own<'a, R>(held: &'a Held<R>, k: &'a [R], v: &'a [R]) -> (&'a [R], &'a [R]) {
    match held {
        Some((hk, hv)) => (hk, hv),
        None => (k, v),
    }
}

fn starts(problem: &RingProblem, rank: usize) -> Vec<usize> {
    rank_pieces(problem, rank).into_iter().map(|r| r.start).collect()
}

/// Forward of the chunk ring on this rank: `q`, `k`, `v` are its pieces ([`rank_pieces`]
/// order, `[batch, rows, heads or kv_heads, head_dim]`). Every rank calls it with the same
/// problem; a disagreement, bad shape, dead or stalled peer or corrupted message is an
/// error on every rank.
pub fn chunk_forward<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    [q, k, v]: [&[X::Rows]; 3],
) -> Result<ChunkForward<X::Rows, X::RowStats>>
where
    T: Element,
    X: ChunkCompute<T>,
    Tr: ChunkTransport<T, X> + ?Sized,
{
    let rank = transport.control().rank();
    let (h, kvh) = (problem.heads, problem.kv_heads);
    let tensors = [(TensorName::Query, q, h), (TensorName::Key, k, kvh), (TensorName::Value, v, kvh)];
    let err = check_pieces(compute, problem, rank, &tensors);
    let start = open_call::<T, _>(transport.control(), "chunk-forward", problem, err)?;
    let masks = compute.masks(problem)?;
    let partials = forward_pass(transport, compute, problem, &masks, [q, k, v])?;
    let stats = finish(transport.control(), start)?;
    let (out, lse) =
        partials.iter().map(|p| compute.finish_forward(problem, p)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
    Ok(ChunkForward { out, lse, stats })
}

/// `world` steps: the blocks of the k/v pieces held (own first), then shift them on.
fn forward_pass<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    masks: &X::Masks,
    [q, k, v]: [&[X::Rows]; 3],
) -> Result<Vec<X::Partial>>
where
    T: Element,
    X: ChunkCompute<T>,
    Tr: ChunkTransport<T, X> + ?Sized,
{
    let (r, p) = (transport.control().rank(), problem.world);
    let q_starts = starts(problem, r);
    let mut partials = q.iter().map(|t| compute.empty_partial(compute.shape_of(t))).collect::<Result<Vec<_>>>()?;
    let mut held: Held<X::Rows> = None;
    for t in 0..p {
        let owner = (r + p - t) % p;
        let (ks, vs) = held_or_own(&held, k, v);
        let k_starts = starts(problem, owner);
        for (partial, (qt, &q_start)) in partials.iter_mut().zip(q.iter().zip(&q_starts)) {
            for ((kt, vt), &k_start) in ks.iter().zip(vs).zip(&k_starts) {
                if !reaches(compute, problem, (qt, q_start), (kt, k_start)) {
                    continue;
                }
                let blk = ChunkBlock { problem, masks, q: qt, q_start, k: kt, v: vt, k_start };
                compute.forward_block(&blk, partial)?;
            }
        }
        if t + 1 < p {
            let travel = Travel { owner, step: t + 1, k: ks, v: vs, dk: &[], dv: &[] };
            let a = transport.shift(compute, problem, &travel)?;
            held = Some((a.k, a.v));
        }
    }
    Ok(partials)
}

/// Exact backward of the chunk ring on this rank: the forward recomputed for the final lse
/// and `delta`, then `world` steps in which k/v pieces travel with their dk/dv, which
/// a last shift brings home. Inputs as [`chunk_forward`], `grad_out` like `q`.
pub fn chunk_backward<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    [q, k, v]: [&[X::Rows]; 3],
    grad_out: &[X::Rows],
) -> Result<ChunkGradients<X::Rows>>
where
    T: Element,
    X: ChunkCompute<T>,
    Tr: ChunkTransport<T, X> + ?Sized,
{
    let rank = transport.control().rank();
    let (h, kvh) = (problem.heads, problem.kv_heads);
    let tensors = [
        (TensorName::Query, q, h),
        (TensorName::Key, k, kvh),
        (TensorName::Value, v, kvh),
        (TensorName::GradOutput, grad_out, h),
    ];
    let err = check_pieces(compute, problem, rank, &tensors);
    let start = open_call::<T, _>(transport.control(), "chunk-backward", problem, err)?;
    let masks = compute.masks(problem)?;
    let partials = forward_pass(transport, compute, problem, &masks, [q, k, v])?;
    let (mut lse, mut delta) = (Vec::new(), Vec::new());
    for (partial, go) in partials.iter().zip(grad_out) {
        let (out, l) = compute.finish_forward(problem, partial)?;
        delta.push(compute.delta(go, &out)?);
        lse.push(l);
    }
    drop(partials);

    let (r, p) = (rank, problem.world);
    let q_starts = starts(problem, r);
    let zeros = |xs: &[X::Rows]| xs.iter().map(|x| compute.zero_acc(compute.shape_of(x))).collect::<Result<Vec<_>>>();
    let (mut dq, mut dk, mut dv) = (zeros(q)?, zeros(k)?, zeros(k)?);
    let mut held: Held<X::Rows> = None;
    for t in 0..p {
        let owner = (r + p - t) % p;
        let (ks, vs) = held_or_own(&held, k, v);
        let k_starts = starts(problem, owner);
        for (qi, (qt, &q_start)) in q.iter().zip(&q_starts).enumerate() {
            let up = ChunkUpstream { grad_out: &grad_out[qi], lse: &lse[qi], delta: &delta[qi] };
            for (j, ((kt, vt), &k_start)) in ks.iter().zip(vs).zip(&k_starts).enumerate() {
                if !reaches(compute, problem, (qt, q_start), (kt, k_start)) {
                    continue;
                }
                let blk = ChunkBlock { problem, masks: &masks, q: qt, q_start, k: kt, v: vt, k_start };
                let grads = ChunkGrads { dq: &mut dq[qi], dk: &mut dk[j], dv: &mut dv[j] };
                compute.backward_block(&blk, &up, grads)?;
            }
        }
        if p > 1 {
            // The last shift carries only the gradients, home to their owner.
            let last = t + 1 == p;
            let (tk, tv) = if last { (&[][..], &[][..]) } else { (ks, vs) };
            let travel = Travel { owner, step: t + 1, k: tk, v: tv, dk: &dk, dv: &dv };
            let a = transport.shift(compute, problem, &travel)?;
            (dk, dv) = (a.dk, a.dv);
            held = Some((a.k, a.v));
        }
    }
    drop(held);
    let stats = finish(transport.control(), start)?;
    let store = |xs: &[X::Acc]| xs.iter().map(|a| compute.store_acc(a)).collect::<Result<Vec<_>>>();
    Ok(ChunkGradients { dq: store(&dq)?, dk: store(&dk)?, dv: store(&dv)?, stats })
}
