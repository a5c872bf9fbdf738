//! The head strategies' all-to-all over `NcclDeviceTransport` on the stand-in libraries:
//! ranks on threads, each on a stand-in device of its own, every member's parcel sent in
//! one grouped NCCL round between device buffers. Every value names its sender, its
//! receiver, its buffer and its place, so a part delivered to the wrong member, out of
//! order or cut short is seen; parts of uneven sizes, empty parts (no buffers) and the
//! self part (handed back without travelling) are among them. A size the receiver does
//! not expect, and a member dying mid-exchange, are typed errors on every rank within
//! the timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attn_core::{AttnError, Result, Shape4};
use attn_ring::chunk_ring::{ChunkTransport, CpuChunks, Exchange, NcclDeviceTransport, Parcel, ParcelShapes};
use attn_ring::{Communicator, Fault, FaultyComm, ThreadComm};
use cudarc::driver::CudaContext;
use half::bf16;

use super::device_ring::{Dev, StandInChunks, dev_err};

/// What rank `from` sends rank `to`: an uneven number of row buffers (bf16) and of f32
/// accumulators, of uneven sizes; none at all between ranks 0 and 3.
fn shapes(from: usize, to: usize) -> ParcelShapes {
    let shape = |seq, heads, d| Shape4::new(1, seq, heads, d).expect("shape");
    ParcelShapes {
        rows: (0..(from + to) % 3).map(|b| shape(1 + (from * 3 + to + b) % 4, 2, 3)).collect(),
        accs: (0..(from + 2 * to) % 3).map(|b| shape(1 + (to + b) % 3, 2, 1 + b)).collect(),
    }
}

/// Value `e` of row buffer `b` from `from` to `to` (exact in bf16: below 256).
fn row_value(from: usize, to: usize, b: usize, e: usize) -> f32 {
    (from * 64 + to * 16 + (b * 5 + e) % 16) as f32
}

/// Value `e` of accumulator `b` from `from` to `to`.
fn acc_value(from: usize, to: usize, b: usize, e: usize) -> f32 {
    (from * 10_000 + to * 1_000 + b * 100 + e) as f32
}

/// Device buffers of the parcel `from` sends `to`.
fn parcel(x: &StandInChunks, from: usize, to: usize) -> Result<Parcel<Dev<bf16>, Dev<f32>>> {
    let want = shapes(from, to);
    let mut rows = Vec::new();
    for (b, &shape) in want.rows.iter().enumerate() {
        let vals: Vec<bf16> = (0..shape.numel()).map(|e| bf16::from_f32(row_value(from, to, b, e))).collect();
        rows.push(Arc::new(Dev { data: x.up(&vals)?, shape }));
    }
    let mut accs = Vec::new();
    for (b, &shape) in want.accs.iter().enumerate() {
        let vals: Vec<f32> = (0..shape.numel()).map(|e| acc_value(from, to, b, e)).collect();
        accs.push(Dev { data: x.up(&vals)?, shape });
    }
    Ok(Parcel { rows, accs })
}

/// Error unless `got` is the parcel `from` sent `to`, value for value.
fn check_parcel(x: &StandInChunks, got: &Parcel<Dev<bf16>, Dev<f32>>, from: usize, to: usize) -> Result<()> {
    let want = shapes(from, to);
    let wrong = |what: String| AttnError::InvalidArgument(format!("rank {to} from rank {from}: {what}"));
    let got_rows: Vec<Shape4> = got.rows.iter().map(|r| r.shape).collect();
    let got_accs: Vec<Shape4> = got.accs.iter().map(|a| a.shape).collect();
    if got_rows != want.rows || got_accs != want.accs {
        return Err(wrong(format!("shapes {got_rows:?} and {got_accs:?}, wanted {:?} and {:?}", want.rows, want.accs)));
    }
    for (b, r) in got.rows.iter().enumerate() {
        let vals: Vec<f32> = x.down(&r.data)?.iter().map(|v| v.to_f32()).collect();
        let expected: Vec<f32> = (0..r.shape.numel()).map(|e| row_value(from, to, b, e)).collect();
        if vals != expected {
            return Err(wrong(format!("row buffer {b} holds {vals:?}, wanted {expected:?}")));
        }
    }
    for (b, a) in got.accs.iter().enumerate() {
        let vals = x.down(&a.data)?;
        let expected: Vec<f32> = (0..a.shape.numel()).map(|e| acc_value(from, to, b, e)).collect();
        if vals != expected {
            return Err(wrong(format!("accumulator {b} holds {vals:?}, wanted {expected:?}")));
        }
    }
    Ok(())
}

/// Run `work(rank, compute, transport)` on `world` ranks over NCCL between stand-in device
/// buffers (rank `i` on device `i`), its control communicator threads with `timeout`
/// suffering `faults(rank)`.
fn on_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    faults: impl Fn(usize) -> Vec<Fault> + Sync,
    work: impl Fn(usize, &StandInChunks, &mut Transport) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    let comms = ThreadComm::world_with_timeout(world, timeout).expect("threads");
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (faults, work) = (&faults, &work);
                s.spawn(move || -> Result<R> {
                    let ctx = CudaContext::new(rank).map_err(dev_err)?;
                    let x = StandInChunks { stream: ctx.new_stream().map_err(dev_err)?, cpu: CpuChunks::default() };
                    let mut t = NcclDeviceTransport::bootstrap(FaultyComm::new(comm, faults(rank)), &ctx)?;
                    work(rank, &x, &mut t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

type Transport = NcclDeviceTransport<FaultyComm<ThreadComm>, Dev<bf16>, Dev<f32>>;

/// The all-to-all of rank `rank` over `members`, each member's parcel as [`parcel`] makes
/// it, expecting `expect(from)` from each.
fn exchange(
    rank: usize,
    x: &StandInChunks,
    t: &mut Transport,
    members: &[usize],
    expect: impl Fn(usize) -> ParcelShapes,
) -> Result<Vec<Parcel<Dev<bf16>, Dev<f32>>>> {
    let parcels = members.iter().map(|&m| parcel(x, rank, m)).collect::<Result<Vec<_>>>()?;
    let expect: Vec<ParcelShapes> = members.iter().map(|&m| expect(m)).collect();
    ChunkTransport::<bf16, StandInChunks>::all_to_all(t, x, Exchange::HeadsIn, members, parcels, &expect)
}

/// Every rank's parts reach the right member, in order and whole: four ranks as one group
/// (Ulysses), then as two groups of two (the hybrid's), on one communicator.
pub fn every_part_reaches_its_member() {
    let groups: [&[&[usize]]; 2] = [&[&[0, 1, 2, 3]], &[&[0, 1], &[2, 3]]];
    let res = on_ranks(
        4,
        Duration::from_secs(20),
        |_| Vec::new(),
        |rank, x, t| {
            let mut parts = 0;
            for members in groups.iter().flat_map(|g| g.iter().filter(|m| m.contains(&rank))) {
                let got = exchange(rank, x, t, members, |m| shapes(m, rank))?;
                for (p, &m) in got.iter().zip(members.iter()) {
                    check_parcel(x, p, m, rank)?;
                    parts += 1;
                }
            }
            Ok(parts)
        },
    );
    let parts: Vec<usize> = res.into_iter().map(|r| r.expect("rank")).collect();
    assert_eq!(parts, vec![6; 4]);
    let all = (0..4).flat_map(|f| (0..4).map(move |t| shapes(f, t)));
    let (empty, rows): (Vec<_>, Vec<_>) = all.partition(|s| s.rows.is_empty() && s.accs.is_empty());
    let sizes: std::collections::BTreeSet<usize> = rows.iter().flat_map(|s| s.rows.iter().map(|r| r.seq)).collect();
    assert!(empty.len() >= 2 && sizes.len() >= 3, "{} empty parts, row sizes {sizes:?}", empty.len());
    println!(
        "all-to-all: 4 ranks, groups of 4 and of 2: {} parts each arrived whole ({} empty)",
        parts[0],
        empty.len()
    );
}

/// Rank 2 expects one more row from rank 0 than rank 0 sends: rank 2 refuses at the header
/// (naming both sizes) before any NCCL call; the others, left waiting in the round for
/// rank 2, time out. Every rank fails with a typed error, none hangs.
pub fn a_size_the_receiver_does_not_expect_fails_at_the_header() {
    let start = Instant::now();
    let res = on_ranks(
        3,
        Duration::from_millis(500),
        |_| Vec::new(),
        |rank, x, t| {
            exchange(rank, x, t, &[0, 1, 2], |m| {
                let mut want = shapes(m, rank);
                if (m, rank) == (0, 2) {
                    want.rows[0].seq += 1;
                }
                want
            })
            .map(|_| ())
        },
    );
    let waited = start.elapsed();
    match &res[2] {
        Err(AttnError::Comm { message, .. }) if message.contains("this rank expects") => {}
        other => panic!("rank 2: expected the header's size error, got {other:?}"),
    }
    for r in &res[..2] {
        assert!(matches!(r, Err(AttnError::Comm { .. } | AttnError::Timeout { .. })), "{res:?}");
    }
    assert!(waited < Duration::from_secs(10), "took {waited:?}");
    println!("all-to-all: a size the receiver does not expect: {res:?} after {waited:?}");
}

/// Rank 1 dies at each frame it sends from joining to the all-to-all's headers (the last:
/// after its header reached one member but not the other, which has posted its round):
/// every rank fails with a typed error within the timeout. Without the fault every rank
/// succeeds, so each fault is what fails them.
pub fn a_member_dying_mid_exchange_is_an_error_on_every_rank() {
    let timeout = Duration::from_millis(500);
    let work = |rank: usize, x: &StandInChunks, t: &mut Transport| -> Result<u64> {
        let sent = ChunkTransport::<bf16, StandInChunks>::control(t).stats().messages_sent;
        exchange(rank, x, t, &[0, 1, 2], |m| shapes(m, rank))?;
        Ok(sent)
    };
    let clean: Vec<u64> = on_ranks(3, timeout, |_| Vec::new(), work).into_iter().map(|r| r.expect("clean")).collect();
    // Rank 1's frames: those of joining, then one header to each of the two other members.
    let frames = clean[1] + 2;
    for nth in 0..frames {
        let start = Instant::now();
        let res = on_ranks(3, timeout, |r| if r == 1 { vec![Fault::Kill { nth }] } else { Vec::new() }, work);
        let waited = start.elapsed();
        for (rank, r) in res.iter().enumerate() {
            assert!(
                matches!(r, Err(AttnError::Comm { .. } | AttnError::Timeout { .. })),
                "rank 1 killed at frame {nth}: rank {rank} got {r:?}"
            );
        }
        assert!(waited < Duration::from_secs(10), "rank 1 killed at frame {nth}: took {waited:?}");
    }
    println!("all-to-all: rank 1 killed at each of its {frames} frames: a typed error on every rank each time");
}
