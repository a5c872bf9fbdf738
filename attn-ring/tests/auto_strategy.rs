//! `Strategy::Auto` runs what its cost model picks: where it picks Ulysses or a hybrid,
//! a call sends exactly the bytes and messages of that strategy (`expected_traffic` of
//! Auto's plan, and what the explicit strategy's run sends), and its output and gradients
//! equal the float64 reference; where it keeps the row plan, likewise for the rows.

use crate::common;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DType, DilatedConfig, Pass, Shape4, TensorView};
use attn_ring::plan::choose::Candidate;
use attn_ring::{
    Layout, Plan, RingProblem, RingStats, Strategy, ThreadComm, Traffic, expected_traffic, run_problem_backward_on,
    run_problem_on,
};
use attn_testkit::golden::Problem;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use attn_testkit::random_vec;
use common::views;

fn measured(stats: &[RingStats]) -> Vec<Traffic> {
    stats.iter().map(|s| Traffic { bytes: s.data_bytes_sent, messages: s.data_messages }).collect()
}

/// (segments, rates, heads, world) and the strategy Auto must run there.
type Case = (Vec<usize>, Vec<usize>, usize, usize, Strategy);

fn cases() -> [Case; 5] {
    [
        // Dense attention, 8 heads on 4 ranks: Ulysses.
        (vec![1024], vec![1], 8, 4, Strategy::Ulysses),
        // On 8 ranks, at this size the hybrid's fewer messages (7 against 14) outweigh
        // Ulysses' fewer bytes.
        (vec![1024], vec![1], 8, 8, Strategy::Hybrid { ulysses: 4 }),
        // 4 heads on 8 ranks: Ulysses cannot run; the hybrid of degree 4.
        (vec![1024], vec![1], 4, 8, Strategy::Hybrid { ulysses: 4 }),
        // Rate 8: an eighth of the rows travel by all-gather; the row plan stays.
        (vec![1024], vec![8], 8, 4, Strategy::Auto),
        // Segments inside ranks: the row plan, which sends nothing.
        (vec![64], vec![1], 8, 8, Strategy::Auto),
    ]
}

#[test]
fn auto_sends_what_its_pick_sends_and_equals_the_reference() {
    for (w, r, heads, world, want) in cases() {
        let cfg = DilatedConfig::builder().segments(&w).dilations(&r).build().unwrap();
        let shape = AttnShape::self_attn(Shape4::new(1, 1024, heads, 32).unwrap());
        let problem = RingProblem::new(&cfg, shape, Layout::Contiguous, Strategy::Auto, world);
        let plan = Plan::new(problem.clone()).unwrap();
        let picked = plan.head_split().map_or(Strategy::Auto, |s| Candidate::Heads(*s).strategy());
        assert_eq!(picked, want, "{w:?} {r:?} heads {heads} p={world}");

        let n = shape.q.numel();
        let (q, k, v, go) = (random_vec(1, n), random_vec(2, n), random_vec(3, n), random_vec(4, n));
        let qkv = views(shape, &q, &k, &v).unwrap();
        let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape.q).unwrap();
        let f = run_problem_on(ThreadComm::world(world).unwrap(), &problem, qkv).unwrap();
        let b = run_problem_backward_on(ThreadComm::world(world).unwrap(), &problem, qkv, gov).unwrap();
        let case = format!("{w:?} {r:?} heads {heads} p={world} ({want:?})");
        assert_eq!(measured(&f.stats), expected_traffic(&plan, DType::F32, Pass::Forward), "fwd {case}");
        assert_eq!(measured(&b.stats), expected_traffic(&plan, DType::F32, Pass::Backward), "bwd {case}");
        if want != Strategy::Auto {
            let explicit = RingProblem { strategy: want, ..problem.clone() };
            let e = run_problem_on(ThreadComm::world(world).unwrap(), &explicit, qkv).unwrap();
            assert_eq!(measured(&f.stats), measured(&e.stats), "{case}");
            assert!(f.stats.iter().all(|s| s.data_messages > 0), "{case}");
        }

        let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
        let reference = Problem::new(&cfg, shape);
        let expected = Expected::for_problem(&reference, [&wide(&q), &wide(&k), &wide(&v)], Some(&wide(&go))).unwrap();
        let mut rows = judge_forward(&expected, &f.out, &f.lse, DType::F32);
        rows.extend(judge_backward(&expected, [&b.dq, &b.dk, &b.dv], DType::F32));
        let v = verdict(&rows);
        assert!(v.is_ok(), "{case}: {}", v.unwrap_err());
    }
}
