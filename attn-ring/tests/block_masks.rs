//! Block masks across ranks: every `conformance/blocks` file through the ring at every
//! world size 1..=8, layout and strategy (forward and gradients, equal to the file), and
//! through the head strategies (Ulysses, hybrid); a mask passed by only some ranks, or a
//! different mask on one rank, is `RankDisagreement` on every rank (no rank waits on the
//! others).

use crate::common;

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Masks, Shape4, TensorView,
    TensorViewMut,
};
use attn_ring::{Communicator, Layout, RingBackend, Strategy, ThreadComm, local_rows};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use common::golden_sweep_cases;

const WORLD: usize = 3;

#[test]
fn ring_matches_every_block_mask_file() {
    let cases: Vec<GoldenCase> =
        load_dir(&golden_dir().join("blocks")).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
    assert_eq!(cases.len(), 8);
    let runs =
        golden_sweep_cases(cases, 1..=8, |world, layout, strategy| common::RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), BLOCK_RUNS);
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
