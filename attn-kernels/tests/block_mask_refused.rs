//! The CPU kernels do not compute block masks yet: a block-masked call, forward or
//! backward, is `Unsupported { backend: "cpu", feature: BlockMask }`, while the same call
//! without the mask runs.

use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Feature, Grads, Masks, Saved,
    Shape4, TensorView, TensorViewMut,
};
use attn_kernels::CpuBackend;

#[test]
fn the_cpu_backend_refuses_a_block_mask_by_name() {
    let cfg = DilatedConfig::new(&[8], &[1]).unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, 8, 2, 4).unwrap());
    let x: Vec<f32> = (0..shape.q.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
    let dims = BlockDims { batch: 1, heads: 1, q_blocks: 2, k_blocks: 2 };
    let block = BlockMaskBuf::from_fn(dims, 4, |_, _, i, j| j <= i).unwrap();
    let be = CpuBackend::new(1).unwrap();
    let plain = AttnInputs::contiguous(&cfg, shape, [&x, &x, &x]).unwrap();
    let masked = plain.with_masks(Masks { block: Some(block.view()), ..Masks::NONE });
    let refused = |r: attn_core::Result<()>| {
        matches!(r, Err(AttnError::Unsupported { backend: "cpu", feature: Feature::BlockMask }))
    };
    let (mut out, mut lse) = (vec![0f32; shape.q.numel()], vec![0f32; shape.q.lse_len()]);
    let name = attn_core::TensorName::Output;
    assert!(refused(be.forward(&masked, TensorViewMut::contiguous(name, &mut out, shape.q).unwrap(), &mut lse)));
    be.forward(&plain, TensorViewMut::contiguous(name, &mut out, shape.q).unwrap(), &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0f32; x.len()], vec![0f32; x.len()], vec![0f32; x.len()]);
    let saved = Saved { out: TensorView::contiguous(attn_core::TensorName::Output, &out, shape.q).unwrap(), lse: &lse };
    let grad_out = TensorView::contiguous(attn_core::TensorName::GradOutput, &x, shape.q).unwrap();
    let grads = Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv]).unwrap();
    assert!(refused(be.backward(&masked, saved, grad_out, grads)));
    let err = be.forward(&masked, TensorViewMut::contiguous(name, &mut out, shape.q).unwrap(), &mut lse).unwrap_err();
    assert_eq!(err.to_string(), "cpu does not support block masks");
}
