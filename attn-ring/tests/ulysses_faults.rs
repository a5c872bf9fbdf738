//! Faults during the head strategies' all-to-alls: every injected fault (drop,
//! duplicate, reorder, truncate, corrupt, kill) on every frame one rank sends ends in a
//! typed error on every rank (before the verdict round) or the right answer, within the
//! timeout: a dead peer mid-exchange never hangs a rank or yields a wrong value.

use crate::common;

use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Mixing, Shape4, TensorView};
use attn_ring::{Communicator, Fault, FaultyComm, Layout, RankForward, Strategy, ThreadComm, forward_on, problem_for};
use attn_testkit::random_vec;
use common::faults_at;

const P: usize = 4;

fn run(faulty_rank: usize, faults: Vec<Fault>, timeout: Duration, strategy: Strategy) -> Vec<RankForward<f32>> {
    let cfg = DilatedConfig::builder().segments(&[8, 32]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    let shape = Shape4::new(1, 32, 4, 4).unwrap();
    let n = shape.numel();
    let [q, k, v] = [random_vec(21, n), random_vec(22, n), random_vec(23, n)];
    let comms: Vec<FaultyComm<ThreadComm>> = ThreadComm::world_with_timeout(P, timeout)
        .unwrap()
        .into_iter()
        .map(|c| {
            let f = if c.rank() == faulty_rank { faults.clone() } else { Vec::new() };
            FaultyComm::new(c, f)
        })
        .collect();
    let problem = problem_for(&cfg.build().unwrap(), shape, Layout::Zigzag, strategy, P);
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    forward_on(comms, &problem, view(&q), view(&k), view(&v))
}

#[test]
fn every_fault_in_the_all_to_alls_is_a_typed_error_or_the_right_answer() {
    for strategy in [Strategy::Ulysses, Strategy::Hybrid { ulysses: 2 }] {
        let clean: Vec<_> =
            run(0, Vec::new(), Duration::from_secs(10), strategy).into_iter().map(|r| r.unwrap()).collect();
        let faulty = 1;
        // Handshake (P-1 frames), data, completion tables and verdicts (P-1 frames each).
        let frames = clean[faulty].2.data_messages + 3 * (P as u64 - 1);
        assert!(clean[faulty].2.data_messages >= 3, "{strategy:?}");
        for nth in 0..=frames {
            for fault in faults_at(nth, Duration::ZERO).into_iter().filter(|f| !matches!(f, Fault::Delay { .. })) {
                let start = Instant::now();
                let res = run(faulty, vec![fault], Duration::from_millis(150), strategy);
                assert!(start.elapsed() < Duration::from_secs(5), "{fault:?} took {:?}", start.elapsed());
                let mut errors = 0;
                for (rank, r) in res.iter().enumerate() {
                    match r {
                        Ok((out, lse, _)) => assert_eq!((out, lse), (&clean[rank].0, &clean[rank].1), "{fault:?}"),
                        Err(e) => {
                            let typed = matches!(e, AttnError::Comm { .. } | AttnError::Timeout { .. });
                            assert!(typed, "{fault:?} ({strategy:?}): untyped {e}");
                            errors += 1;
                        }
                    }
                }
                // Before the verdict round a fault fails every rank alike.
                if nth + (P as u64 - 1) < frames {
                    assert_eq!(errors, P, "{fault:?} at frame {nth} ({strategy:?}): {res:?}");
                }
            }
        }
    }
}
