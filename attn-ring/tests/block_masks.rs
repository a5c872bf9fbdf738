//! Block masks across ranks: every `conformance/blocks` file through the ring at every
//! world size 1..=8, layout and strategy (forward and gradients, equal to the file, and
//! every rank's bytes equal to the plan's formula), and through the head strategies
//! (Ulysses, hybrid); the ring moves only the key rows kept blocks reach (a local window
//! of density `f` sends at most `(f + 1/nb)` of the dense ring's bytes); a mask passed by
//! only some ranks, or a different mask on one rank, is `RankDisagreement` on every rank
//! (no rank waits on the others).

use crate::common;

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, BlockPattern, DType, DilatedConfig, Masks,
    OwnedMasks, Pass, Shape4, TensorView, TensorViewMut,
};
use attn_ring::{
    Communicator, Layout, Plan, RingBackend, RingProblem, Strategy, ThreadComm, expected_bytes, local_rows,
    run_problem_backward_on, run_problem_on,
};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use attn_testkit::random_vec;
use common::{golden_sweep_cases, views};

const WORLD: usize = 3;

#[test]
fn ring_matches_every_block_mask_file() {
    let cases: Vec<GoldenCase> =
        load_dir(&golden_dir().join("blocks")).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
    assert_eq!(cases.len(), 8);
    let runs =
        golden_sweep_cases(cases, 1..=8, |world, layout, strategy| common::RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), BLOCK_RUNS);
    let mut checked = 0;
    for run in &runs {
        let inputs = random_inputs(&run.problem);
        ring_bytes_equal_the_formula(&run.problem, &inputs);
        checked += 1;
    }
    assert_eq!(checked, BLOCK_RUNS);
}

/// Random q, k, v and grad_out of `problem`'s shape (the bytes do not depend on values).
fn random_inputs(problem: &RingProblem) -> Vec<Vec<f32>> {
    let (q, kv) = (problem.batch * problem.seq * problem.heads, problem.batch * problem.seq * problem.kv_heads);
    let d = problem.head_dim;
    vec![random_vec(1, q * d), random_vec(2, kv * d), random_vec(3, kv * d), random_vec(4, q * d)]
}

/// Every rank of `problem` sends exactly `expected_bytes`, forward and backward.
fn ring_bytes_equal_the_formula(problem: &RingProblem, qkvg: &[Vec<f32>]) {
    let q = Shape4::new(problem.batch, problem.seq, problem.heads, problem.head_dim).unwrap();
    let shape = AttnShape { q, kv: Shape4 { heads: problem.kv_heads, ..q } };
    let [qv, kv, vv] = views(shape, &qkvg[0], &qkvg[1], &qkvg[2]).unwrap();
    let plan = Plan::new(problem.clone()).unwrap();
    let p = problem.world;
    let label = format!("p={p} {:?} {:?} {:?}", problem.layout, problem.strategy, problem.cfg);
    let f = run_problem_on(ThreadComm::world(p).unwrap(), problem, [qv, kv, vv]).unwrap();
    let got: Vec<u64> = f.stats.iter().map(|s| s.data_bytes_sent).collect();
    assert_eq!(got, expected_bytes(&plan, DType::F32, Pass::Forward), "forward {label}");
    let go = TensorView::contiguous(TensorName::GradOutput, &qkvg[3], q).unwrap();
    let b = run_problem_backward_on(ThreadComm::world(p).unwrap(), problem, [qv, kv, vv], go).unwrap();
    let got: Vec<u64> = b.stats.iter().map(|s| s.data_bytes_sent).collect();
    assert_eq!(got, expected_bytes(&plan, DType::F32, Pass::Backward), "backward {label}");
}

/// A local window keeping `f` of the tiles makes the ring (contiguous layout, full
/// attention, 4 ranks) send at most `(f + 1/nb)` of the bytes it sends with every block
/// kept, summed over ranks, forward and backward; the bytes equal the formula.
#[test]
fn a_local_window_mask_sends_at_most_its_density_of_the_dense_ring_bytes() {
    let (n, bs, world) = (512, 16, 4);
    let nb = n / bs;
    let q = Shape4::new(2, n, 2, 8).unwrap();
    let shape = AttnShape { q, kv: Shape4 { heads: 1, ..q } };
    let cfg = DilatedConfig::new(&[n], &[1]).unwrap();
    let data = vec![random_vec(1, q.numel()), random_vec(2, n * 16), random_vec(3, n * 16), random_vec(4, q.numel())];
    let dense = RingProblem::new(&cfg, shape, Layout::Contiguous, Strategy::Ring, world);
    let sum = |problem: &RingProblem, pass: Pass| -> u64 {
        expected_bytes(&Plan::new(problem.clone()).unwrap(), DType::F32, pass).iter().sum()
    };
    ring_bytes_equal_the_formula(&dense, &data);
    for window_blocks in [1, 2, 4, 8] {
        let pattern = BlockPattern::LocalWindow { window_blocks };
        let mask = BlockMaskBuf::from_pattern(&pattern, bs, n, n).unwrap();
        let f = mask.view().kept_tiles(0, 0) as f64 / (nb * nb) as f64;
        let masked = dense.clone().with_masks(OwnedMasks::none().with_block_mask(mask));
        ring_bytes_equal_the_formula(&masked, &data);
        for pass in [Pass::Forward, Pass::Backward] {
            let (got, full) = (sum(&masked, pass), sum(&dense, pass));
            let bound = (f + 1.0 / nb as f64) * full as f64;
            assert!(got as f64 <= bound, "{pattern} {pass:?}: {got} bytes, {full} dense, f = {f:.3}, bound {bound:.0}");
        }
    }
}

/// The (file, world, layout, strategy) runs of the sweep above: every layout a file's
/// length splits into at each world size.
const BLOCK_RUNS: usize = 8 * 8 * 2 * 3;

/// Every rank's result when the ranks pass `masks[rank]` (None: no block mask).
fn ranks_with(masks: &[Option<BlockMaskBuf>]) -> Vec<attn_core::Result<()>> {
    let cfg = DilatedConfig::new(&[12], &[1]).unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, 12, 2, 4).unwrap());
    let x: Vec<f32> = (0..shape.q.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
    let comms = ThreadComm::world(WORLD).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (x, cfg) = (&x, &cfg);
                scope.spawn(move || -> attn_core::Result<()> {
                    let rank = comm.rank();
                    let be = RingBackend::new(comm, shape.q.seq, Layout::Contiguous, Strategy::Auto)?;
                    let pos = be.positions();
                    let local = shape.q.with_seq(pos.len())?;
                    let rows = local_rows(&TensorView::contiguous(TensorName::Query, x, shape.q)?, &pos)?;
                    let block = masks[rank].as_ref().map(BlockMaskBuf::view);
                    let inputs = AttnInputs::contiguous(cfg, AttnShape::self_attn(local), [&rows, &rows, &rows])?
                        .with_masks(Masks { block, ..Masks::NONE });
                    let (mut out, mut lse) = (vec![0f32; local.numel()], vec![0f32; local.lse_len()]);
                    be.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, local)?, &mut lse)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_that_pass_different_block_masks_all_fail_alike() {
    let dims = BlockDims { batch: 1, heads: 1, q_blocks: 3, k_blocks: 3 };
    let lower = BlockMaskBuf::from_fn(dims, 4, |_, _, i, j| j <= i).unwrap();
    let diagonal = BlockMaskBuf::from_fn(dims, 4, |_, _, i, j| j == i).unwrap();
    let same = ranks_with(&[Some(lower.clone()), Some(lower.clone()), Some(lower.clone())]);
    assert!(same.iter().all(Result::is_ok), "{same:?}");
    for masks in
        [vec![None, Some(lower.clone()), None], vec![Some(lower.clone()), Some(diagonal.clone()), Some(lower.clone())]]
    {
        for (rank, r) in ranks_with(&masks).iter().enumerate() {
            assert!(matches!(r, Err(AttnError::RankDisagreement(_))), "rank {rank}: {r:?}");
        }
    }
}
