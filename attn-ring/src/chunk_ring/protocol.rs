//! The chunk ring's calls: local checks and the handshake; per round, the trips of the
//! problem's strategy for that round's slices ([`chunk_trips`]: a trip each way along the
//! ring, or straight to each rank that needs them), each rank computing its queries against the k/v slices it
//! holds while they move on (the backward's dk/dv travelling with their k/v, then straight
//! home); the completion rounds. Under `Strategy::Ulysses` and `Strategy::Hybrid` the same
//! handshake and completion frame the head all-to-all of [`super::heads`].

use std::sync::Arc;

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, Shape4};

use super::heads::HeadCall;
use super::reach::{chunk_trips, may_attend};
use super::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkOptions, ChunkTransport, ChunkUpstream, HeadSlot, RoundSlice, Travel,
    TravelKind, piece_shapes, rank_pieces, round_slices,
};
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

/// A wrong piece count or shape of the LSE's gradient (one `[batch, rows, heads]` piece per
/// query piece), if any.
fn check_grad_lse<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    q: &[X::Rows],
    grad_lse: Option<&[X::RowStats]>,
) -> Option<String> {
    let g = grad_lse?;
    let want: Vec<_> = q.iter().map(|p| Some(Shape4 { head_dim: 1, ..compute.shape_of(p) }.dims())).collect();
    let got: Vec<_> = g.iter().map(|p| compute.stats_shape(p).map(|s| s.dims())).collect();
    (got != want).then(|| {
        format!(
            "{} pieces have shapes {got:?} (None: values that do not fill their shape), expected {want:?}",
            TensorName::GradLse
        )
    })
}

/// The masks and what the blocks need loaded (a device's kernels, compiled on a machine's
/// first call), prepared before the handshake: a slow load is waited for there, and a
/// failed one becomes this rank's refusal (`err`, unless it already holds one), so every
/// rank reports it instead of timing out in a round.
fn prepare<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    problem: &RingProblem,
    err: Option<String>,
) -> (Result<X::Masks>, Option<String>) {
    let masks = compute.masks(problem);
    let err = err.or_else(|| masks.as_ref().err().map(|e| format!("preparing the masks and kernels failed: {e}")));
    (masks, err)
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

/// The completion rounds and the call's statistics: the control communicator's since the
/// call opened (`start`: its statistics then, and what the transport had moved) plus what
/// the transport moved beside it.
fn close_call<T: Element, X: ChunkCompute<T>, Tr: ChunkTransport<T, X> + ?Sized>(
    transport: &mut Tr,
    (start, moved): ((CommStats, CommStats), CommStats),
) -> Result<RingStats> {
    let mut stats = finish(transport.control(), start)?;
    let now = transport.moved();
    stats.data_bytes_sent += now.payload_bytes_sent - moved.payload_bytes_sent;
    stats.data_messages += now.messages_sent - moved.messages_sent;
    stats.total_bytes_sent += now.frame_bytes_sent - moved.frame_bytes_sent;
    Ok(stats)
}

/// Whether the call runs a head strategy (Ulysses or the hybrid: an explicit one with
/// something to exchange, `crate::plan::choose::runs_heads`; `Auto` keeps the row plan on
/// the chunk ring). A compute that cannot copy heads refuses it here, before the
/// handshake, the same on every rank.
fn heads_strategy<T: Element, X: ChunkCompute<T>>(compute: &X, problem: &RingProblem, q: &[X::Rows]) -> Result<bool> {
    if !crate::plan::choose::runs_heads(problem) {
        return Ok(false);
    }
    if let Some(p) = q.first() {
        compute.take_heads(p, 0..1)?;
    }
    Ok(true)
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

fn starts(problem: &RingProblem, rank: usize) -> Vec<usize> {
    rank_pieces(problem, rank).into_iter().map(|r| r.start).collect()
}

/// Whether no rank's queries reach another rank's keys (one rank, or every segment and
/// band inside a rank's pieces): then nothing travels and each rank attends its own
/// pieces whole, without slicing them into rounds.
fn stays_home(problem: &RingProblem) -> bool {
    problem.world == 1 || chunk_trips(problem, 0, 1).is_empty()
}

fn shapes_of(problem: &RingProblem, slices: &[RoundSlice]) -> Result<Vec<Shape4>> {
    slices.iter().map(|s| Shape4::new(problem.batch, s.rows.len(), problem.kv_heads, problem.head_dim)).collect()
}

/// A round's k and v slices (shared with the transport while they move).
type KvSlices<R> = (Vec<Arc<R>>, Vec<Arc<R>>);

/// Slices of `owner`'s k/v held by a rank, with their first global positions.
struct Held<R> {
    owner: usize,
    k: Vec<Arc<R>>,
    v: Vec<Arc<R>>,
    starts: Vec<usize>,
}

impl<R> Clone for Held<R> {
    fn clone(&self) -> Self {
        Held { owner: self.owner, k: self.k.clone(), v: self.v.clone(), starts: self.starts.clone() }
    }
}

fn refs<R>(xs: &[Arc<R>]) -> Vec<&R> {
    xs.iter().map(|x| &**x).collect()
}

/// Copies of the round's slices of the rank's own k and v.
fn own_slices<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    slices: &[RoundSlice],
    [k, v]: [&[X::Rows]; 2],
) -> Result<KvSlices<X::Rows>> {
    let copy = |xs: &[X::Rows]| {
        slices
            .iter()
            .map(|s| compute.slice_rows(&xs[s.piece], s.rows.clone()).map(Arc::new))
            .collect::<Result<Vec<_>>>()
    };
    Ok((copy(k)?, copy(v)?))
}

/// Forward of the chunk ring on this rank: `q`, `k`, `v` are its pieces ([`rank_pieces`]
/// order, `[batch, rows, heads or kv_heads, head_dim]`). Every rank calls it with the same
/// problem and options; a disagreement, bad shape, dead or stalled peer or corrupted
/// message is an error on every rank.
pub fn chunk_forward<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    opts: ChunkOptions,
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
    let heads = heads_strategy(compute, problem, q)?;
    let (masks, err) = prepare(compute, problem, check_pieces(compute, problem, rank, &tensors));
    let op = format!("chunk-forward rounds={}", opts.rounds());
    let start = (open_call::<T, _>(transport.control(), &op, problem, err)?, transport.moved());
    let masks = masks?;
    if heads {
        let (out, lse) = HeadCall::new(compute, problem, &masks, rank)?.forward(transport, [q, k, v])?;
        let stats = close_call::<T, X, _>(transport, start)?;
        return Ok(ChunkForward { out, lse, stats });
    }
    let partials = forward_pass(transport, compute, problem, opts, &masks, [q, k, v])?;
    let stats = close_call::<T, X, _>(transport, start)?;
    let (out, lse) =
        partials.iter().map(|p| compute.finish_forward(problem, p)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
    Ok(ChunkForward { out, lse, stats })
}

/// Every round, the trips of [`chunk_trips`], each starting from the rank's own slices and
/// passing on what it holds; every slice held (the own ones once) is attended while the
/// next travel moves.
fn forward_pass<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    opts: ChunkOptions,
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
    let mut attend = |ks: &[&X::Rows], vs: &[&X::Rows], k_starts: &[usize]| -> Result<()> {
        for (partial, (qt, &q_start)) in partials.iter_mut().zip(q.iter().zip(&q_starts)) {
            for ((&kt, &vt), &k_start) in ks.iter().zip(vs).zip(k_starts) {
                if !reaches(compute, problem, (qt, q_start), (kt, k_start)) {
                    continue;
                }
                let blk = ChunkBlock { problem, masks, q: qt, q_start, k: kt, v: vt, k_start, heads: HeadSlot::Every };
                compute.forward_block(&blk, partial)?;
            }
        }
        Ok(())
    };
    if stays_home(problem) {
        attend(&k.iter().collect::<Vec<_>>(), &v.iter().collect::<Vec<_>>(), &starts(problem, r))?;
        return Ok(partials);
    }
    let rounds = opts.rounds();
    let mut step = 0;
    for round in 0..rounds {
        let trips = chunk_trips(problem, round, rounds);
        let mine = round_slices(problem, r, round, rounds);
        let (ks, vs) = own_slices(compute, &mine, [k, v])?;
        let own = Held { owner: r, k: ks, v: vs, starts: mine.iter().map(|s| s.start).collect() };
        // Each arrival (the own slices first) is attended while the next travel moves.
        let mut pending = Some(own.clone());
        for trip in &trips {
            let mut held = own.clone();
            for _ in 0..trip.steps {
                step += 1;
                let from_owner = (held.owner + p - trip.hop) % p;
                let from = round_slices(problem, from_owner, round, rounds);
                let (kind, owner, hop, arriving) = (TravelKind::Kv, held.owner, trip.hop, shapes_of(problem, &from)?);
                let (k, v, dk, dv) = (held.k, held.v, Vec::new(), Vec::new());
                transport.start(compute, problem, Travel { kind, owner, hop, step, k, v, dk, dv, arriving })?;
                let done = pending.take().map_or(Ok(()), |x| attend(&refs(&x.k), &refs(&x.v), &x.starts));
                // Finished even after a failed block, so nothing is in flight when the error returns.
                let arrived = transport.finish(compute, problem);
                done?;
                let a = arrived?;
                held = Held { owner: from_owner, k: a.k, v: a.v, starts: from.iter().map(|s| s.start).collect() };
                pending = Some(held.clone());
            }
        }
        if let Some(x) = pending {
            attend(&refs(&x.k), &refs(&x.v), &x.starts)?;
        }
    }
    Ok(partials)
}

/// Exact backward of the chunk ring on this rank: the forward recomputed for the final lse
/// and `delta`, then per round the forward's trips, k/v slices travelling with their
/// dk/dv, which a last travel of each trip brings straight home. Inputs as [`chunk_forward`],
/// `grad_out` like `q`; `grad_lse`, where the loss reaches the LSE, like the forward's `lse`
/// (one per query piece): the gradients are those of `sum(out * grad_out) + sum(lse *
/// grad_lse)`.
pub fn chunk_backward<T, X, Tr>(
    transport: &mut Tr,
    compute: &X,
    problem: &RingProblem,
    opts: ChunkOptions,
    [q, k, v]: [&[X::Rows]; 3],
    grad_out: &[X::Rows],
    grad_lse: Option<&[X::RowStats]>,
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
    let heads = heads_strategy(compute, problem, q)?;
    let err = check_pieces(compute, problem, rank, &tensors).or_else(|| check_grad_lse(compute, q, grad_lse));
    let (masks, err) = prepare(compute, problem, err);
    let op = format!("chunk-backward rounds={}", opts.rounds());
    let start = (open_call::<T, _>(transport.control(), &op, problem, err)?, transport.moved());
    let masks = masks?;
    if heads {
        let call = HeadCall::new(compute, problem, &masks, rank)?;
        let [dq, dk, dv] = call.backward(transport, [q, k, v], grad_out, grad_lse)?;
        let stats = close_call::<T, X, _>(transport, start)?;
        return Ok(ChunkGradients { dq, dk, dv, stats });
    }
    let partials = forward_pass(transport, compute, problem, opts, &masks, [q, k, v])?;
    let (mut lse, mut delta) = (Vec::new(), Vec::new());
    for (i, (partial, go)) in partials.iter().zip(grad_out).enumerate() {
        let (out, l) = compute.finish_forward(problem, partial)?;
        delta.push(compute.delta(go, &out, grad_lse.map(|g| (&g[i], &l)))?);
        lse.push(l);
    }
    drop(partials);

    let (r, p) = (rank, problem.world);
    let q_starts = starts(problem, r);
    let mut dq = q.iter().map(|x| compute.zero_acc(compute.shape_of(x))).collect::<Result<Vec<_>>>()?;
    let ups: Vec<_> = grad_out
        .iter()
        .zip(lse.iter().zip(&delta))
        .map(|(grad_out, (lse, delta))| ChunkUpstream { grad_out, lse, delta })
        .collect();
    let mut attend = |ks: &[&X::Rows], vs: &[&X::Rows], k_starts: &[usize], dks: &mut [X::Acc], dvs: &mut [X::Acc]| {
        for (qi, (qt, &q_start)) in q.iter().zip(&q_starts).enumerate() {
            for (j, ((&kt, &vt), &k_start)) in ks.iter().zip(vs).zip(k_starts).enumerate() {
                if !reaches(compute, problem, (qt, q_start), (kt, k_start)) {
                    continue;
                }
                let blk = ChunkBlock {
                    problem,
                    masks: &masks,
                    q: qt,
                    q_start,
                    k: kt,
                    v: vt,
                    k_start,
                    heads: HeadSlot::Every,
                };
                let grads = ChunkGrads { dq: &mut dq[qi], dk: &mut dks[j], dv: &mut dvs[j] };
                compute.backward_block(&blk, &ups[qi], grads)?;
            }
        }
        Ok::<_, AttnError>(())
    };
    // The rank's dk/dv per piece, in `T`, filled slice by slice as they come home.
    let mut dk_home: Vec<Option<X::Rows>> = k.iter().map(|_| None).collect();
    let mut dv_home: Vec<Option<X::Rows>> = k.iter().map(|_| None).collect();
    // Where nothing travels, one round over the own pieces whole.
    let home = stays_home(problem);
    let rounds = if home { 1 } else { opts.rounds() };
    let mut step = 0;
    for round in 0..rounds {
        let trips = chunk_trips(problem, round, rounds);
        let own = round_slices(problem, r, round, rounds);
        let own_starts: Vec<_> = own.iter().map(|s| s.start).collect();
        let zeros = |s: &[RoundSlice]| {
            shapes_of(problem, s)?.into_iter().map(|x| compute.zero_acc(x)).collect::<Result<Vec<_>>>()
        };
        let (mut dks, mut dvs) = (zeros(&own)?, zeros(&own)?);
        if home {
            let (k, v): (Vec<_>, Vec<_>) = (k.iter().collect(), v.iter().collect());
            attend(&k, &v, &own_starts, &mut dks, &mut dvs)?;
        } else {
            let (ks, vs) = own_slices(compute, &own, [k, v])?;
            attend(&refs(&ks), &refs(&vs), &own_starts, &mut dks, &mut dvs)?;
            // Each trip carries the k/v with the dk/dv accumulated so far, every rank on the
            // way adding its blocks' gradients, then the dk/dv alone straight home.
            for trip in &trips {
                let (mut hk, mut hv, mut owner) = (ks.clone(), vs.clone(), r);
                for _ in 0..trip.steps {
                    step += 1;
                    let from_owner = (owner + p - trip.hop) % p;
                    let from = round_slices(problem, from_owner, round, rounds);
                    let (kind, hop, arriving) = (TravelKind::KvGrad, trip.hop, shapes_of(problem, &from)?);
                    let travel = Travel { kind, owner, hop, step, k: hk, v: hv, dk: dks, dv: dvs, arriving };
                    let mut a = transport.shift(compute, problem, travel)?;
                    let starts: Vec<_> = from.iter().map(|s| s.start).collect();
                    attend(&refs(&a.k), &refs(&a.v), &starts, &mut a.dk, &mut a.dv)?;
                    (hk, hv, dks, dvs, owner) = (a.k, a.v, a.dk, a.dv, from_owner);
                }
                step += 1;
                let (kind, hop, arriving) =
                    (TravelKind::GradHome, p - trip.hop * trip.steps % p, shapes_of(problem, &own)?);
                let travel =
                    Travel { kind, owner, hop, step, k: Vec::new(), v: Vec::new(), dk: dks, dv: dvs, arriving };
                let a = transport.shift(compute, problem, travel)?;
                (dks, dvs) = (a.dk, a.dv);
            }
        }
        for (s, (dk, dv)) in own.iter().zip(dks.iter().zip(&dvs)) {
            store_home(compute, problem, r, s, dk, &mut dk_home)?;
            store_home(compute, problem, r, s, dv, &mut dv_home)?;
        }
    }
    let stats = close_call::<T, X, _>(transport, start)?;
    let store = |xs: &[X::Acc]| xs.iter().map(|a| compute.store_acc(a)).collect::<Result<Vec<_>>>();
    let home = |xs: Vec<Option<X::Rows>>| {
        xs.into_iter()
            .map(|x| x.ok_or_else(|| AttnError::InvalidArgument("a k/v piece whose gradient never came home".into())))
            .collect::<Result<Vec<_>>>()
    };
    Ok(ChunkGradients { dq: store(&dq)?, dk: home(dk_home)?, dv: home(dv_home)?, stats })
}

/// Store a slice's finished gradient (in `T`) into its piece's rows.
fn store_home<T: Element, X: ChunkCompute<T>>(
    compute: &X,
    problem: &RingProblem,
    rank: usize,
    slice: &RoundSlice,
    acc: &X::Acc,
    home: &mut [Option<X::Rows>],
) -> Result<()> {
    let rows = compute.store_acc(acc)?;
    if slice.whole {
        home[slice.piece] = Some(rows);
        return Ok(());
    }
    let dst = match &mut home[slice.piece] {
        Some(d) => d,
        empty => {
            let shape = piece_shapes(problem, rank, problem.kv_heads)?[slice.piece];
            empty.insert(compute.zero_rows(shape)?)
        }
    };
    compute.write_rows(dst, slice.rows.start, &rows)
}
