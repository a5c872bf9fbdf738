//! `RingOptions::threads`: a rank computing on several threads (own-key chunks, blocks
//! split by (batch, head), forward and backward) gives bit for bit the result of one
//! thread, for every layout, strategy and world size, causal or not.

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Mixing, Shape4, TensorView};
use attn_ring::{
    Layout, RingOptions, RingProblem, Strategy, ThreadComm, backward_on_with, forward_on_with, problem_for,
};
use attn_testkit::random_vec;

fn config(segments: &[usize], mixing: Mixing, causal: bool) -> DilatedConfig {
    DilatedConfig::builder()
        .segments(segments)
        .dilations(&[1, 2, 3])
        .mixing(mixing)
        .causality(causal.into())
        .build()
        .unwrap()
}

/// Every rank's (out, lse) with `threads` compute threads per rank.
fn forward_results(problem: &RingProblem, threads: usize, qkv: [TensorView<'_, f32>; 3]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let opts = RingOptions::default().with_threads(threads);
    forward_on_with(ThreadComm::world(problem.world).unwrap(), problem, &opts, qkv)
        .into_iter()
        .map(|r| r.map(|(out, lse, _)| (out, lse)).unwrap())
        .collect()
}

#[test]
fn rank_threads_do_not_change_the_result() {
    // 1500 rows: several 512-row chunks per rank at p = 1 and 2, ragged last chunks.
    let shape = Shape4::new(2, 1500, 3, 16).unwrap();
    let (q, k, v) = (random_vec(31, shape.numel()), random_vec(32, shape.numel()), random_vec(33, shape.numel()));
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for (mixing, causal) in [(Mixing::HeadGroups, false), (Mixing::LongNet, true)] {
        let cfg = config(&[300, 700, 1500], mixing, causal);
        for world in [1, 2, 3] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                let problem = problem_for(&cfg, shape, layout, Strategy::AllGather, world);
                let run = |threads: usize| forward_results(&problem, threads, [view(&q), view(&k), view(&v)]);
                let one = run(1);
                assert!(one.iter().all(|(o, _)| o.iter().any(|x| *x != 0.0)), "outputs are written");
                for threads in [2, 3, 16] {
                    assert!(run(threads) == one, "{mixing:?} causal={causal} p={world} {layout:?} threads={threads}");
                }
            }
        }
    }
}

#[test]
fn rank_threads_do_not_change_ring_pass_forward_or_backward() {
    // heads 3, batch 2: six (batch, head) items; segments that span ranks go by ring
    // pass (forward) and through both the ring and the all-gather backward.
    let shape = Shape4::new(2, 900, 3, 16).unwrap();
    let n = shape.numel();
    let (q, k, v, g) = (random_vec(41, n), random_vec(42, n), random_vec(43, n), random_vec(44, n));
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for (mixing, causal) in [(Mixing::HeadGroups, true), (Mixing::LongNet, false)] {
        let cfg = config(&[200, 450, 900], mixing, causal);
        for (world, layout, strategy) in [
            (1, Layout::Contiguous, Strategy::Ring),
            (2, Layout::Zigzag, Strategy::Ring),
            (3, Layout::Contiguous, Strategy::Ring),
            (3, Layout::Zigzag, Strategy::AllGather),
        ] {
            let problem = problem_for(&cfg, shape, layout, strategy, world);
            let fwd = |threads: usize| forward_results(&problem, threads, [view(&q), view(&k), view(&v)]);
            let bwd = |threads: usize| {
                let opts = RingOptions::default().with_threads(threads);
                let comms = ThreadComm::world(world).unwrap();
                backward_on_with(comms, &problem, &opts, [view(&q), view(&k), view(&v)], view(&g))
                    .into_iter()
                    .map(|r| r.map(|(grads, _)| grads).unwrap())
                    .collect::<Vec<_>>()
            };
            let (f1, b1) = (fwd(1), bwd(1));
            assert!(f1.iter().all(|(o, _)| o.iter().any(|x| *x != 0.0)), "outputs are written");
            assert!(b1.iter().all(|gr| gr.iter().all(|x| x.iter().any(|y| *y != 0.0))), "gradients are written");
            for threads in [2, 4, 7] {
                let what = format!("{mixing:?} causal={causal} p={world} {layout:?} {strategy:?} threads={threads}");
                assert!(fwd(threads) == f1, "forward: {what}");
                assert!(bwd(threads) == b1, "backward: {what}");
            }
        }
    }
}
