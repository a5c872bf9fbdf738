//! Injected communication faults on the ring (drop, delay, duplicate, reorder, truncate,
//! corrupt, kill) through `attn_ring::FaultyComm`, on every frame one rank sends: no
//! rank ever returns a wrong answer, every error is a typed communication error, the
//! whole run finishes under a watchdog, and a pure delay gives the exact clean result.

use std::time::Duration;

use crate::common;
use attn_core::{AttnError, DilatedConfig, Mixing, Result, Shape4};

use attn_reliability::watchdog::within;
use attn_ring::{Fault, Layout, Strategy};
use common::ring_harness::{Op, RingCase};

/// Receive timeout in the fault runs: a lost frame becomes `Timeout` this fast.
const FAULT_TIMEOUT: Duration = Duration::from_millis(150);
/// Generous timeout for runs that must succeed (clean and pure-delay runs).
const CLEAN_TIMEOUT: Duration = Duration::from_secs(10);
/// Whole-test watchdog.
const WATCHDOG: Duration = Duration::from_secs(60);

fn case(world: usize, strategy: Strategy, layout: Layout) -> RingCase {
    // Segments of 8 stay inside ranks; segments of 32 span all of them (rate 2, 4).
    let cfg = DilatedConfig::builder().segments(&[8, 32, 32]).dilations(&[1, 2, 4]).mixing(Mixing::LongNet).causal();
    let shape = Shape4::new(1, 32, 2, 4).unwrap();
    RingCase::new(&cfg.build().unwrap(), shape, layout, strategy, world, 42)
}

fn typed(e: &AttnError) -> bool {
    matches!(e, AttnError::Comm { .. } | AttnError::Timeout { .. } | AttnError::RankDisagreement(_))
}

/// What one fault run ended in.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    runs: usize,
    all_err: usize,
    /// Some ranks finished (with the exact clean result) while others failed: only
    /// allowed (when `strict`) if the fault hit the final completion round.
    mixed: usize,
    all_ok: usize,
}

/// Inject `make(nth)` at every `nth` of rank `faulty`'s frames and check each run: never
/// a wrong answer, only typed errors; with `strict`, a run where some ranks succeed and
/// others fail is allowed only when the fault hit the final completion round (which no
/// finite protocol can make all-or-nothing).
fn attack(c: &RingCase, op: Op, faulty: usize, kind: &str, make: fn(u64) -> Fault, strict: bool) -> Tally {
    let clean: Vec<Vec<f32>> =
        c.run_faulty(op, faulty, vec![], CLEAN_TIMEOUT).into_iter().collect::<Result<_>>().expect("clean run");
    let frames = c.frames_sent(op, CLEAN_TIMEOUT).expect("frame count")[faulty];
    let world = c.problem.world as u64;
    let mut t = Tally::default();
    for nth in 0..frames {
        let res = c.run_faulty(op, faulty, vec![make(nth)], FAULT_TIMEOUT);
        t.runs += 1;
        let mut oks = 0;
        for (rank, r) in res.iter().enumerate() {
            match r {
                Ok(got) => {
                    oks += 1;
                    let same = got.len() == clean[rank].len()
                        && got.iter().zip(&clean[rank]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{kind} at frame {nth} of rank {faulty} ({op:?}): rank {rank} returned a WRONG answer"
                    );
                }
                Err(e) => assert!(typed(e), "{kind} at frame {nth} ({op:?}): rank {rank} got untyped error {e}"),
            }
        }
        // The last `world - 1` frames of a rank are its completion-round (barrier) frames.
        let final_round = nth + world > frames;
        match oks {
            0 => t.all_err += 1,
            n if n == res.len() => t.all_ok += 1,
            _ => {
                let errs: Vec<String> = res.iter().filter_map(|r| r.as_ref().err().map(|e| e.to_string())).collect();
                assert!(
                    final_round || !strict,
                    "{kind} at frame {nth}/{frames} ({op:?}): {oks} ranks succeeded while others failed with {errs:?}"
                );
                t.mixed += 1;
            }
        }
        assert!(t.all_ok == 0 || !strict, "{kind} at frame {nth}/{frames} ({op:?}) went unnoticed by every rank");
    }
    eprintln!("{kind:>9} {op:?} world={world}: {t:?} (frames of rank {faulty}: {frames})");
    t
}

/// A fault kind's name and how to make it for frame `nth`.
type FaultKind = (&'static str, fn(u64) -> Fault);

const KINDS: [FaultKind; 5] = [
    ("drop", |nth| Fault::Drop { nth }),
    ("reorder", |nth| Fault::Reorder { nth }),
    ("truncate", |nth| Fault::Truncate { nth }),
    ("corrupt", |nth| Fault::Corrupt { nth }),
    ("kill", |nth| Fault::Kill { nth }),
];

fn attack_all(world: usize, strategy: Strategy, layout: Layout, op: Op, faulty: usize) {
    within(WATCHDOG, move || {
        let c = case(world, strategy, layout);
        for (kind, make) in KINDS {
            let t = attack(&c, op, faulty, kind, make, true);
            assert!(t.runs > 0);
        }
    })
    .unwrap_or_else(|h| panic!("fault runs did not finish within {:?}: a hang", h.after));
}

#[test]
fn every_fault_in_the_ring_forward_is_caught() {
    attack_all(4, Strategy::Ring, Layout::Contiguous, Op::Forward, 1);
}

#[test]
fn every_fault_in_the_allgather_forward_is_caught() {
    attack_all(4, Strategy::AllGather, Layout::Zigzag, Op::Forward, 2);
}

#[test]
fn every_fault_in_the_ring_backward_is_caught() {
    attack_all(4, Strategy::Ring, Layout::Zigzag, Op::Backward, 3);
}

#[test]
fn every_fault_at_world_8_is_caught() {
    attack_all(8, Strategy::Auto, Layout::Contiguous, Op::Forward, 5);
}

fn duplicates(strict: bool) {
    within(WATCHDOG, move || {
        for (world, op) in [(4, Op::Forward), (4, Op::Backward), (8, Op::Forward)] {
            let c = case(world, Strategy::Ring, Layout::Zigzag);
            attack(&c, op, 1, "duplicate", |nth| Fault::Duplicate { nth }, strict);
        }
    })
    .unwrap_or_else(|h| panic!("duplicate runs did not finish within {:?}: a hang", h.after));
}

#[test]
fn duplicated_frames_never_give_a_wrong_answer() {
    duplicates(false);
}

/// A duplicate before the final completion round fails every rank; one in the final
/// round fails the rank that receives it (attn-ring two-round completion).
#[test]
fn duplicated_frames_fail_every_rank() {
    duplicates(true);
}

/// Receive timeout of the pure-delay runs: every injected delay, and any chain of
/// them across ranks (at most 4 x 40 ms), stays well under it.
const DELAY_TIMEOUT: Duration = Duration::from_millis(500);
/// Delays of the delayed ranks, by their index in the run's list (all under the timeout).
const DELAYS_MS: [u64; 3] = [20, 30, 40];

/// Delays on several ranks at once (each on a different frame, sweeping every frame of
/// every delayed rank), for the ring and all-gather strategies, contiguous and zigzag,
/// forward and backward: every rank returns exactly (bitwise) the clean result.
#[test]
fn pure_delays_on_several_ranks_give_the_exact_clean_result() {
    let runs = within(Duration::from_secs(240), || {
        let mut runs = 0;
        let variants: [(usize, Strategy, Layout, &[usize]); 5] = [
            (4, Strategy::Ring, Layout::Contiguous, &[0, 2, 3]),
            (4, Strategy::Ring, Layout::Zigzag, &[1, 2]),
            (4, Strategy::AllGather, Layout::Zigzag, &[0, 1, 3]),
            (8, Strategy::Auto, Layout::Contiguous, &[1, 4, 6]),
            (8, Strategy::AllGather, Layout::Zigzag, &[0, 3, 5, 7]),
        ];
        for (world, strategy, layout, delayed) in variants {
            let c = case(world, strategy, layout);
            for op in [Op::Forward, Op::Backward] {
                let clean: Vec<Vec<f32>> =
                    c.run_faulty(op, 0, vec![], CLEAN_TIMEOUT).into_iter().collect::<Result<_>>().expect("clean run");
                let frames = c.frames_sent(op, CLEAN_TIMEOUT).expect("frame count");
                let sweep = delayed.iter().map(|&r| frames[r]).max().unwrap_or(0);
                for nth in 0..sweep {
                    // The i-th delayed rank stalls its frame (nth + i) mod its frame count.
                    let mut faults = vec![Vec::new(); world];
                    for (i, &r) in delayed.iter().enumerate() {
                        let delay = Duration::from_millis(DELAYS_MS[i % DELAYS_MS.len()]);
                        faults[r].push(Fault::Delay { nth: (nth + i as u64) % frames[r], delay });
                    }
                    let res = c.run_with_faults(op, &faults, DELAY_TIMEOUT);
                    let what = format!("{op:?} world {world} {strategy:?} {layout:?}, delays {faults:?}");
                    assert_eq!(res.len(), clean.len(), "{what}: {} results for {} ranks", res.len(), clean.len());
                    for (rank, (got, want)) in res.iter().zip(&clean).enumerate() {
                        let got = got.as_ref().unwrap_or_else(|e| panic!("{what}: rank {rank} failed: {e}"));
                        assert_eq!(got.len(), want.len(), "{what}: rank {rank} returned {} values", got.len());
                        assert!(
                            got.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{what}: rank {rank} differs from the clean run"
                        );
                    }
                    runs += 1;
                }
            }
        }
        runs
    })
    .expect("delay runs hung");
    eprintln!("pure delays: {runs} runs with 2-4 ranks delayed at once, all bit-identical to the clean runs");
}

#[test]
fn a_delay_past_the_timeout_is_a_typed_error_everywhere() {
    within(WATCHDOG, || {
        let c = case(4, Strategy::Ring, Layout::Contiguous);
        let frames = c.frames_sent(Op::Forward, CLEAN_TIMEOUT).unwrap()[1];
        for nth in [0, frames / 2, frames.saturating_sub(4)] {
            let res = c.run_faulty(
                Op::Forward,
                1,
                vec![Fault::Delay { nth, delay: Duration::from_millis(600) }],
                FAULT_TIMEOUT,
            );
            for (rank, r) in res.iter().enumerate() {
                match r {
                    Err(e) => assert!(typed(e), "rank {rank}: {e}"),
                    Ok(_) => panic!("stall of 600 ms at frame {nth} with a 150 ms timeout: rank {rank} succeeded"),
                }
            }
        }
    })
    .expect("stall runs hung");
}
