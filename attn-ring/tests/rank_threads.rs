//! `RingOptions::threads`: a rank computing its own-key chunks on several threads gives
//! bit for bit the result of one thread, for every layout and world size, causal or not.

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Mixing, Shape4, TensorView};
use attn_ring::{Layout, RingOptions, Strategy, ThreadComm, forward_on_with, problem_for};
use attn_testkit::random_vec;

#[test]
fn rank_threads_do_not_change_the_result() {
    // 1500 rows: several 512-row chunks per rank at p = 1 and 2, ragged last chunks.
    let shape = Shape4::new(2, 1500, 3, 16).unwrap();
    let (q, k, v) = (random_vec(31, shape.numel()), random_vec(32, shape.numel()), random_vec(33, shape.numel()));
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for (mixing, causal) in [(Mixing::HeadGroups, false), (Mixing::LongNet, true)] {
        let cfg = DilatedConfig::builder()
            .segments(&[300, 700, 1500])
            .dilations(&[1, 2, 3])
            .mixing(mixing)
            .causal(causal)
            .build()
            .unwrap();
        for world in [1, 2, 3] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                let problem = problem_for(&cfg, shape, layout, Strategy::AllGather, world);
                let run = |threads: usize| {
                    let comms = ThreadComm::world(world).unwrap();
                    let opts = RingOptions::default().with_threads(threads);
                    forward_on_with(comms, &problem, &opts, [view(&q), view(&k), view(&v)])
                        .into_iter()
                        .map(|r| r.map(|(out, lse, _)| (out, lse)).unwrap())
                        .collect::<Vec<_>>()
                };
                let one = run(1);
                assert!(one.iter().all(|(o, _)| o.iter().any(|x| *x != 0.0)), "outputs are written");
                for threads in [2, 3, 16] {
                    assert!(run(threads) == one, "{mixing:?} causal={causal} p={world} {layout:?} threads={threads}");
                }
            }
        }
    }
}
