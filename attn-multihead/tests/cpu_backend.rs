//! The layer and encoder on the CPU kernels (f32) against the float64 reference: outputs and every gradient.

use std::sync::Arc;

use attn_core::{DType, DilatedConfig, Mixing};
use attn_kernels::CpuBackend;
use attn_multihead::{
    Call, EncoderConfig, LongNetEncoder, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams,
    ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

fn cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(2).unwrap())
}

pub(crate) fn bound() -> f64 {
    Tolerance::for_dtype(DType::F32).rel_l2
}

/// Compare one parameter gradient. The key bias gradient is exactly zero (softmax is
/// invariant to adding `q . b_k` to every score of a row), so it is checked to be
/// round-off small in both instead of relatively.
pub(crate) fn check_grad(what: &str, name: &str, got: &[f32], want: &[f64]) {
    if name.ends_with("k_proj.bias") {
        let max = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(max(&mut want.iter().copied()) < 1e-12, "{what}: reference d {name} not zero");
        assert!(max(&mut got.iter().map(|&x| x as f64)) < 1e-5, "{what}: cpu d {name} not ~zero");
        return;
    }
    let err = rel_l2_error(got, want);
    assert!(err <= bound(), "{what} d {name} {err:.2e}");
}

fn to32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

#[test]
fn layer_forward_and_backward_on_cpu_match_the_reference() {
    for (mixing, causal, seq) in [(Mixing::HeadGroups, false, 48), (Mixing::LongNet, true, 45)] {
        let cfg = MultiheadConfig::new(
            32,
            4,
            DilatedConfig::builder()
                .segments(&[8, 16, 32])
                .dilations(&[1, 2, 4])
                .mixing(mixing)
                .causality(causal.into())
                .build()
                .unwrap(),
        );
        let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 7, Arc::new(ReferenceBackend)).unwrap();
        let w32: MultiheadWeights<f32> = {
            let mut w = MultiheadWeights::<f32>::magneto(&cfg, 0);
            for (d, s) in w.params_mut().into_iter().zip(r64.weights.params()) {
                d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
            }
            w
        };
        let c32 = MultiheadDilatedAttention::from_weights(cfg, w32, cpu()).unwrap();
        let (b, e) = (2, 32);
        let x32 = random_vec(1, b * seq * e);
        let x64: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let g32 = random_vec(2, b * seq * e);
        let g64: Vec<f64> = g32.iter().map(|&v| v as f64).collect();
        let (y64, c64) = r64.forward_train(&x64, &Call::new(b, seq)).unwrap();
        let (y32, cc32) = c32.forward_train(&x32, &Call::new(b, seq)).unwrap();
        assert!(rel_l2_error(&y32, &to32(&y64)) <= bound(), "out {}", rel_l2_error(&y32, &y64));
        let mut gr64 = r64.weights.zeros_like();
        let mut gr32 = c32.weights.zeros_like();
        let dx64 = r64.backward(&c64, &g64, &mut gr64).unwrap().query;
        let dx32 = c32.backward(&cc32, &g32, &mut gr32).unwrap().query;
        let err = rel_l2_error(&dx32, &dx64);
        assert!(err <= bound(), "{mixing:?} dx {err:.2e}");
        for (p32, p64) in gr32.params().into_iter().zip(gr64.params()) {
            check_grad(&format!("{mixing:?}"), &p32.name, p32.data, p64.data);
        }
    }
}

#[test]
fn encoder_stack_on_cpu_matches_the_reference() {
    let cfg = EncoderConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap(), 32);
    let r64 = LongNetEncoder::<f64>::new(cfg.clone(), 2, 3, Arc::new(ReferenceBackend)).unwrap();
    let mut c32 = LongNetEncoder::<f32>::new(cfg, 2, 99, cpu()).unwrap();
    for (d, s) in c32.params_mut().into_iter().zip(r64.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    let (b, n, e) = (1, 40, 16);
    let x32 = random_vec(5, b * n * e);
    let x64: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
    let g32 = random_vec(6, b * n * e);
    let g64: Vec<f64> = g32.iter().map(|&v| v as f64).collect();
    let (y64, k64) = r64.forward_train(&x64, &Call::new(b, n)).unwrap();
    let (y32, k32) = c32.forward_train(&x32, &Call::new(b, n)).unwrap();
    assert!(rel_l2_error(&y32, &y64) <= bound());
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
