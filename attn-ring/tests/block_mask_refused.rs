//! The ring does not compute block masks yet: a block-masked call is `Unsupported { backend:
//! "ring", feature: BlockMask }` on every rank, whether every rank or only one passes the
//! mask (no rank waits on the others), and a ring problem holding one has no plan.

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Feature, Masks, OwnedMasks,
    Shape4, TensorView, TensorViewMut,
};
use attn_ring::{Communicator, Layout, Plan, RingBackend, RingProblem, Strategy, ThreadComm, local_rows};

const WORLD: usize = 3;

fn refused<T>(r: &attn_core::Result<T>) -> bool {
    matches!(r, Err(AttnError::Unsupported { backend: "ring", feature: Feature::BlockMask }))
}

#[test]
fn every_rank_refuses_a_block_mask() {
    let cfg = DilatedConfig::new(&[12], &[1]).unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, 12, 2, 4).unwrap());
    let x: Vec<f32> = (0..shape.q.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
    let dims = BlockDims { batch: 1, heads: 1, q_blocks: 3, k_blocks: 3 };
    let block = BlockMaskBuf::from_fn(dims, 4, |_, _, i, j| j <= i).unwrap();
    for masked_ranks in [vec![0, 1, 2], vec![1]] {
        let comms = ThreadComm::world(WORLD).unwrap();
        let results: Vec<attn_core::Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let (block, masked_ranks, x, cfg) = (&block, &masked_ranks, &x, &cfg);
                    scope.spawn(move || -> attn_core::Result<()> {
                        let rank = comm.rank();
                        let be = RingBackend::new(comm, shape.q.seq, Layout::Contiguous, Strategy::Auto)?;
                        let pos = be.positions();
                        let local = shape.q.with_seq(pos.len())?;
                        let rows = local_rows(&TensorView::contiguous(TensorName::Query, x, shape.q)?, &pos)?;
                        let block = masked_ranks.contains(&rank).then(|| block.view());
                        let inputs = AttnInputs::contiguous(cfg, AttnShape::self_attn(local), [&rows, &rows, &rows])?
                            .with_masks(Masks { block, ..Masks::NONE });
                        let (mut out, mut lse) = (vec![0f32; local.numel()], vec![0f32; local.lse_len()]);
                        be.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, local)?, &mut lse)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results.len(), WORLD);
        for (rank, r) in results.iter().enumerate() {
            assert!(refused(r), "masked ranks {masked_ranks:?}, rank {rank}: {:?}", r.as_ref().err());
        }
    }
    let problem = RingProblem::new(&cfg, shape, Layout::Contiguous, Strategy::Auto, WORLD)
        .with_masks(OwnedMasks::none().with_block_mask(block));
    assert!(refused(&Plan::new(problem)));
}
