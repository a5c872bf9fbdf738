//! The layer and encoder under a block mask: on the CPU kernels (f32) against the same
//! layer on the float64 reference backend with the same mask (output, input gradient and
//! every parameter gradient), and the mask must change the reference's output, so the
//! check cannot pass with the mask dropped on both sides.

use std::sync::Arc;

use attn_core::{BlockDims, BlockMaskBuf, DilatedConfig, Masks, Mixing};
use attn_kernels::CpuBackend;
use attn_multihead::{
    Call, EncoderConfig, LongNetEncoder, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams,
    ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::rel_l2_error;

use crate::cpu_backend::{bound, check_grad};

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// A per-head mask of `heads` heads over `seq` positions in blocks of `bs`: each head
/// keeps its diagonal and a head-dependent scatter of other tiles.
fn per_head_mask(heads: usize, seq: usize, bs: usize) -> BlockMaskBuf {
    let nb = seq.div_ceil(bs);
    let dims = BlockDims { batch: 1, heads, q_blocks: nb, k_blocks: nb };
    BlockMaskBuf::from_fn(dims, bs, |_, h, i, j| i == j || (i * 7 + j * 3 + h) % 4 == 0).unwrap()
}

#[test]
fn layer_under_a_block_mask_on_cpu_matches_the_reference() {
    for (mixing, causal, seq, bs) in [(Mixing::HeadGroups, false, 48, 8), (Mixing::LongNet, true, 45, 5)] {
        let attention = DilatedConfig::builder()
            .segments(&[8, 16, 32])
            .dilations(&[1, 2, 4])
            .mixing(mixing)
            .causality(causal.into())
            .build()
            .unwrap();
        let cfg = MultiheadConfig::new(32, 4, attention);
        let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 7, Arc::new(ReferenceBackend)).unwrap();
        let w32: MultiheadWeights<f32> = {
            let mut w = MultiheadWeights::<f32>::magneto(&cfg, 0);
            for (d, s) in w.params_mut().into_iter().zip(r64.weights.params()) {
                d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
            }
            w
        };
        let c32 = MultiheadDilatedAttention::from_weights(cfg, w32, Arc::new(CpuBackend::new(2).unwrap())).unwrap();
        let mask = per_head_mask(4, seq, bs);
        let masks = Masks { block: Some(mask.view()), ..Masks::NONE };
        let (b, e) = (1, 32);
        let (x32, g32) = (random_vec(1, b * seq * e), random_vec(2, b * seq * e));
        let (x64, g64) = (to64(&x32), to64(&g32));
        let (y64, c64) = r64.forward_train(&x64, &Call::new(b, seq).masks(masks)).unwrap();
        let (y32, cc32) = c32.forward_train(&x32, &Call::new(b, seq).masks(masks)).unwrap();
        let what = format!("{mixing:?}");
        let (unmasked, _) = r64.forward_train(&x64, &Call::new(b, seq)).unwrap();
        assert!(rel_l2_error(&y64, &unmasked) > 1e-2, "{what}: the mask changes nothing");
        assert!(rel_l2_error(&y32, &y64) <= bound(), "{what} out {:.2e}", rel_l2_error(&y32, &y64));
        let (mut gr64, mut gr32) = (r64.weights.zeros_like(), c32.weights.zeros_like());
        let dx64 = r64.backward(&c64, &g64, &mut gr64).unwrap().query;
        let dx32 = c32.backward(&cc32, &g32, &mut gr32).unwrap().query;
        assert!(rel_l2_error(&dx32, &dx64) <= bound(), "{what} dx {:.2e}", rel_l2_error(&dx32, &dx64));
        for (p32, p64) in gr32.params().into_iter().zip(gr64.params()) {
            check_grad(&what, &p32.name, p32.data, p64.data);
        }
    }
}

#[test]
fn encoder_under_a_block_mask_on_cpu_matches_the_reference() {
    let cfg = EncoderConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap(), 32);
    let r64 = LongNetEncoder::<f64>::new(cfg.clone(), 2, 3, Arc::new(ReferenceBackend)).unwrap();
    let mut c32 = LongNetEncoder::<f32>::new(cfg, 2, 99, Arc::new(CpuBackend::new(2).unwrap())).unwrap();
    for (d, s) in c32.params_mut().into_iter().zip(r64.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    let (b, n, e) = (1, 40, 16);
    let mask = per_head_mask(4, n, 4);
    let masks = Masks { block: Some(mask.view()), ..Masks::NONE };
    let (x32, g32) = (random_vec(5, b * n * e), random_vec(6, b * n * e));
    let (x64, g64) = (to64(&x32), to64(&g32));
    let (y64, k64) = r64.forward_train(&x64, &Call::new(b, n).masks(masks)).unwrap();
    let (y32, k32) = c32.forward_train(&x32, &Call::new(b, n).masks(masks)).unwrap();
    let (unmasked, _) = r64.forward_train(&x64, &Call::new(b, n)).unwrap();
    assert!(rel_l2_error(&y64, &unmasked) > 1e-2, "the mask changes nothing");
    assert!(rel_l2_error(&y32, &y64) <= bound(), "out {:.2e}", rel_l2_error(&y32, &y64));
    let (mut g_r, mut g_c) = (r64.zero_grads(), c32.zero_grads());
    let dx64 = r64.backward(&k64, &g64, &mut g_r).unwrap();
    let dx32 = c32.backward(&k32, &g32, &mut g_c).unwrap();
    assert!(rel_l2_error(&dx32, &dx64) <= bound(), "dx {:.2e}", rel_l2_error(&dx32, &dx64));
    for (lc, lr) in g_c.iter().zip(&g_r) {
        for (p32, p64) in lc.params().into_iter().zip(lr.params()) {
            check_grad("encoder", &p32.name, p32.data, p64.data);
        }
    }
}
