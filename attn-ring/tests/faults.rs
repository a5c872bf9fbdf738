//! Fault injection: every fault on any frame ends in a typed error on every live
//! rank (or, for a short delay, the correct result); never a wrong answer or a
//! hang. Also mismatched configs, bad local shapes, dropped and stalled ranks.

use crate::common;

use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Mixing, Shape4, TensorView, TensorViewMut};
use attn_ring::{
    Communicator, Fault, FaultyComm, Layout, RankForward, Strategy, ThreadComm, backward_on, forward_on, problem_for,
    ring_forward,
};
use attn_testkit::random_vec;
use common::faults_at;

const P: usize = 3;

fn setup() -> (DilatedConfig, Shape4, [Vec<f32>; 3]) {
    let cfg = DilatedConfig::builder().segments(&[8, 30]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    let shape = Shape4::new(1, 30, 2, 4).unwrap();
    let n = shape.numel();
    (cfg.build().unwrap(), shape, [random_vec(11, n), random_vec(12, n), random_vec(13, n)])
}

fn run(faulty_rank: usize, faults: Vec<Fault>, timeout: Duration, strategy: Strategy) -> Vec<RankForward<f32>> {
    let (cfg, shape, [q, k, v]) = setup();
    let comms: Vec<FaultyComm<ThreadComm>> = ThreadComm::world_with_timeout(P, timeout)
        .unwrap()
        .into_iter()
        .map(|c| {
            let f = if c.rank() == faulty_rank { faults.clone() } else { Vec::new() };
            FaultyComm::new(c, f)
        })
        .collect();
    let problem = problem_for(&cfg, shape, Layout::Zigzag, strategy, P);
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    forward_on(comms, &problem, view(&q), view(&k), view(&v))
}

fn is_typed_comm_error(e: &AttnError) -> bool {
    matches!(e, AttnError::Comm { .. } | AttnError::Timeout { .. } | AttnError::RankDisagreement(_))
}

#[test]
fn every_fault_on_every_frame_is_an_error_or_the_right_answer() {
    for strategy in [Strategy::Ring, Strategy::AllGather] {
        let clean = run(0, Vec::new(), Duration::from_secs(10), strategy);
        let clean: Vec<_> = clean.into_iter().map(|r| r.unwrap()).collect();
        for faulty in 0..P {
            // Handshake (P-1 frames), data, completion tables and verdicts (P-1 frames each).
            let frames = clean[faulty].2.data_messages + 3 * (P as u64 - 1);
            for nth in 0..=frames {
                for fault in faults_at(nth, Duration::from_millis(300)) {
                    let start = Instant::now();
                    let res = run(faulty, vec![fault], Duration::from_millis(150), strategy);
                    assert!(start.elapsed() < Duration::from_secs(5), "{fault:?} took {:?}", start.elapsed());
                    let mut errors = 0;
                    for (rank, r) in res.iter().enumerate() {
                        match r {
                            Ok((out, lse, _)) => {
                                assert_eq!((out, lse), (&clean[rank].0, &clean[rank].1), "wrong answer: {fault:?}")
                            }
                            Err(e) => {
                                assert!(is_typed_comm_error(e), "{fault:?} on rank {faulty}: untyped {e}");
                                errors += 1;
                            }
                        }
                    }
                    // Faults before the final (verdict) round reach every rank, duplicates
                    // included; a frame of the verdict round itself can only fail the ranks
                    // that read it, but no fault other than a short delay goes unnoticed.
                    let verdict_round = nth + P as u64 > frames;
                    if nth < frames && !matches!(fault, Fault::Delay { .. }) {
                        assert!(errors > 0, "{fault:?} on rank {faulty} ({strategy:?}) went unnoticed");
                        if !verdict_round {
                            assert_eq!(errors, P, "{fault:?} on rank {faulty} ({strategy:?}): {res:?}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn short_delays_give_the_right_answer() {
    let clean: Vec<_> =
        run(0, Vec::new(), Duration::from_secs(10), Strategy::Ring).into_iter().map(|r| r.unwrap()).collect();
    let faults = (0..12).map(|nth| Fault::Delay { nth, delay: Duration::from_millis(5) }).collect();
    for (rank, r) in run(1, faults, Duration::from_secs(10), Strategy::Ring).into_iter().enumerate() {
        let (out, lse, _) = r.unwrap();
        assert_eq!((out, lse), (clean[rank].0.clone(), clean[rank].1.clone()));
    }
}

#[test]
fn a_stalled_peer_is_a_timeout_and_a_dropped_rank_an_error_everywhere() {
    let stall = run(
        2,
        vec![Fault::Delay { nth: 3, delay: Duration::from_millis(600) }],
        Duration::from_millis(200),
        Strategy::Ring,
    );
    assert!(stall.iter().any(|r| matches!(r, Err(AttnError::Timeout { .. }))), "{stall:?}");
    assert!(stall.iter().all(|r| r.is_err()));
    let killed = run(1, vec![Fault::Kill { nth: 4 }], Duration::from_secs(20), Strategy::Ring);
    // The others notice the dropped channels at once, long before the 20 s timeout.
    assert!(killed.iter().all(|r| matches!(r, Err(AttnError::Comm { .. }))), "{killed:?}");
}

#[test]
fn faults_in_the_backward_are_errors_everywhere() {
    let (cfg, shape, [q, k, v]) = setup();
    let go = random_vec(14, shape.numel());
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for strategy in [Strategy::Ring, Strategy::AllGather] {
        let problem = problem_for(&cfg, shape, Layout::Zigzag, strategy, P);
        // A short timeout for the faulty runs only: a clean run on a busy machine must not time out.
        let run = |faults: Vec<Fault>| {
            let timeout = if faults.is_empty() { Duration::from_secs(10) } else { Duration::from_millis(200) };
            let comms = ThreadComm::world_with_timeout(P, timeout).unwrap();
            let comms = comms.into_iter().map(|c| {
                let f = if c.rank() == 1 { faults.clone() } else { Vec::new() };
                FaultyComm::new(c, f)
            });
            backward_on(comms.collect(), &problem, [view(&q), view(&k), view(&v)], view(&go))
        };
        // Rank 1's data frames follow its P-1 handshake frames; hit the first, middle and last.
        let data = run(Vec::new())[1].as_ref().unwrap().1.data_messages;
        assert!(data >= 3, "{strategy:?}: rank 1 sends {data} data frames");
        let first = P as u64 - 1;
        for nth in [first, first + data / 2, first + data - 1] {
            for fault in [Fault::Kill { nth }, Fault::Corrupt { nth }, Fault::Drop { nth }, Fault::Truncate { nth }] {
                let res = run(vec![fault]);
                let all_failed = res.iter().all(|r| matches!(r, Err(e) if is_typed_comm_error(e)));
                assert!(all_failed, "{fault:?} {strategy:?}: {res:?}");
            }
        }
    }
}

/// Run ring_forward on every rank with a per-rank config / shape; outputs start as 7.
fn run_mixed(cfgs: Vec<DilatedConfig>, seqs: Vec<usize>) -> Vec<(Result<(), AttnError>, bool)> {
    let comms = ThreadComm::world_with_timeout(P, Duration::from_secs(10)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(cfgs.into_iter().zip(seqs))
            .map(|(mut c, (cfg, seq))| {
                s.spawn(move || {
                    let problem =
                        problem_for(&cfg, Shape4::new(1, 30, 2, 4).unwrap(), Layout::Contiguous, Strategy::Auto, P);
                    let ls = Shape4::new(1, seq, 2, 4).unwrap();
                    let x = random_vec(c.rank() as u64, ls.numel());
                    let xv = TensorView::contiguous(TensorName::Query, &x, ls).unwrap();
                    let mut out = vec![7.0f32; ls.numel()];
                    let mut lse = vec![7.0f32; ls.lse_len()];
                    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, ls).unwrap();
                    let r = ring_forward(&mut c, &problem, [xv, xv, xv], &mut ov, &mut lse).map(|_| ());
                    (r, out.iter().chain(&lse).all(|&x| x == 7.0))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn mismatched_config_or_shape_is_the_same_error_on_every_rank_and_writes_nothing() {
    let a = DilatedConfig::new(&[8], &[1]).unwrap();
    let b = DilatedConfig::new(&[8], &[2]).unwrap();
    for (cfgs, seqs) in
        [(vec![a.clone(), a.clone(), b], vec![10; 3]), (vec![a.clone(), a.clone(), a], vec![10, 11, 10])]
    {
        let res = run_mixed(cfgs, seqs);
        let msgs: Vec<String> = res
            .iter()
            .map(|(r, untouched)| {
                assert!(untouched, "output written despite an error");
                match r {
                    Err(e @ AttnError::RankDisagreement(_)) => e.to_string(),
                    other => panic!("expected RankDisagreement, got {other:?}"),
                }
            })
            .collect();
        assert!(msgs.iter().all(|m| *m == msgs[0]), "{msgs:?}");
    }
}
