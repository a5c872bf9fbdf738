//! Cross-attention in `CpuBackend` (k/v with their own sequence length) against the
//! float64 reference: proptest over configs, both mixings, causal or not, shorter and
//! longer key sequences; plus exact identities (equal lengths = self-attention bit for
//! bit, thread-count independence) and typed errors.

use crate::common;

use attn_core::{AttnError, AttnShape, DilatedConfig, Element, Mixing, Shape4};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::judge::judge;
use attn_testkit::random_vec;
use attn_testkit::strategies::{DilatedCase, dilated_case, dilated_case_with};
use common::conv;
use half::bf16;
use proptest::prelude::*;

/// A cross-attention problem: the case's query shape, keys/values of `kv_seq` rows.
struct Cross {
    cfg: DilatedConfig,
    shape: AttnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    go: Vec<f32>,
}

fn cross(case: &DilatedCase, kv_seq: usize) -> Cross {
    let kv = case.shape.with_seq(kv_seq).expect("small shape");
    let shape = AttnShape { q: case.shape, kv };
    let seed = case.seed.wrapping_mul(4);
    Cross {
        cfg: case.cfg.clone(),
        shape,
        q: random_vec(seed, shape.q.numel()),
        k: random_vec(seed.wrapping_add(1), kv.numel()),
        v: random_vec(seed.wrapping_add(2), kv.numel()),
        go: random_vec(seed.wrapping_add(3), shape.q.numel()),
    }
}

/// Forward and backward of `c` in dtype `T` against the reference.
fn check<T: Element>(be: &CpuBackend, c: &Cross) -> Result<(), String> {
    let [q, k, v, go] = [&c.q, &c.k, &c.v, &c.go].map(|x| conv::<T>(x));
    let (out, lse) = be.forward_vec::<T>(&c.cfg, c.shape, &q, &k, &v).map_err(|e| e.to_string())?;
    let (dq, dk, dv) =
        be.backward_vec::<T>(&c.cfg, c.shape, [&q, &k, &v], &out, &lse, &go).map_err(|e| e.to_string())?;
    judge(&c.cfg, c.shape, [&q, &k, &v, &go], &out, &lse, [&dq, &dk, &dv])
}

fn backend(threads: usize, isa: Isa) -> CpuBackend {
    CpuBackend::new(threads).unwrap().with_isa(isa).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(96), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn f32_cross_matches_reference(case in dilated_case(), kv_seq in 1..=60usize) {
        check::<f32>(&backend(2, Isa::detect()), &cross(&case, kv_seq)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn f32_portable_cross_matches_reference(case in dilated_case(), kv_seq in 1..=60usize) {
        check::<f32>(&backend(2, Isa::Portable), &cross(&case, kv_seq)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn f32_larger_cross_matches_reference(case in dilated_case_with(300, 160), kv_seq in 1..=400usize) {
        check::<f32>(&backend(2, Isa::detect()), &cross(&case, kv_seq)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn bf16_cross_matches_reference(case in dilated_case(), kv_seq in 1..=60usize) {
        check::<bf16>(&backend(2, Isa::detect()), &cross(&case, kv_seq)).map_err(TestCaseError::fail)?;
    }
}

/// Fixed multi-tile cases: key sequences shorter and longer than the queries', both
/// mixings, causal or not.
#[test]
fn multi_tile_cross_cases_match_reference() {
    let cases = [
        (&[256, 512][..], &[1, 2][..], Mixing::LongNet, true, 600, 430),
        (&[256, 512][..], &[1, 2][..], Mixing::LongNet, false, 300, 700),
        (&[200, 400][..], &[1, 3][..], Mixing::HeadGroups, true, 500, 900),
        (&[128][..], &[2][..], Mixing::HeadGroups, false, 900, 260),
    ];
    for (i, (w, r, mixing, causal, n, m)) in cases.into_iter().enumerate() {
        let cfg =
            DilatedConfig::builder().segments(w).dilations(r).mixing(mixing).causality(causal.into()).build().unwrap();
        let case = DilatedCase { cfg, shape: Shape4::new(1, n, 2, 40).unwrap(), seed: 300 + i as u64 };
        for isa in common::isas_here("multi_tile_cross_cases_match_reference", Isa::ALL) {
            check::<f32>(&backend(2, isa), &cross(&case, m))
                .unwrap_or_else(|e| panic!("case {i} {}: {e}", isa.as_str()));
        }
    }
}

/// With `kv_seq == seq` the cross entry points are the self-attention ones, bit for bit
/// (including the fused backward chosen for many whole segments).
#[test]
fn equal_lengths_equal_self_attention_bitwise() {
    let cfg = DilatedConfig::builder().segments(&[32, 64]).dilations(&[1, 2]).causal().build().unwrap();
    let case = DilatedCase { cfg, shape: Shape4::new(2, 320, 2, 24).unwrap(), seed: 7 };
    let c = cross(&case, 320);
    let be = backend(2, Isa::detect());
    let s = c.shape.q;
    let (o1, l1) = be.forward_vec(&c.cfg, s, &c.q, &c.k, &c.v).unwrap();
    let (o2, l2) = be.forward_vec(&c.cfg, c.shape, &c.q, &c.k, &c.v).unwrap();
    assert_eq!((o1.clone(), l1.clone()), (o2, l2));
    let g1 = be.backward_vec(&c.cfg, s, [&c.q, &c.k, &c.v], &o1, &l1, &c.go).unwrap();
    let g2 = be.backward_vec(&c.cfg, c.shape, [&c.q, &c.k, &c.v], &o1, &l1, &c.go).unwrap();
    assert_eq!(g1, g2);
}

/// Cross-attention results do not depend on the thread count.
#[test]
fn cross_is_thread_count_independent() {
    let cfg = DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap();
    let case = DilatedCase { cfg, shape: Shape4::new(1, 700, 3, 32).unwrap(), seed: 11 };
    let c = cross(&case, 450);
    let run = |threads| {
        let be = backend(threads, Isa::detect());
        let (o, l) = be.forward_vec(&c.cfg, c.shape, &c.q, &c.k, &c.v).unwrap();
        let g = be.backward_vec(&c.cfg, c.shape, [&c.q, &c.k, &c.v], &o, &l, &c.go).unwrap();
        (o, l, g)
    };
    assert_eq!(run(1), run(2));
}

/// Shapes that disagree beyond the sequence length (batch, head_dim, key/value heads not
/// dividing the query heads) are typed errors; the self-attention entry points still
/// reject another key length.
#[test]
fn cross_shape_errors() {
    let be = backend(1, Isa::detect());
    let cfg = DilatedConfig::new(&[4], &[1]).unwrap();
    let q = Shape4::new(1, 8, 2, 4).unwrap();
    let x = vec![0.5f32; 256];
    let bad = [Shape4::new(2, 8, 2, 4).unwrap(), Shape4::new(1, 8, 3, 4).unwrap(), Shape4::new(1, 8, 2, 8).unwrap()];
    for kv in bad {
        let shape = AttnShape { q, kv };
        let r = be.forward_vec(&cfg, shape, &x[..q.numel()], &x[..kv.numel()], &x[..kv.numel()]);
        assert!(matches!(r, Err(AttnError::ShapeMismatch { .. } | AttnError::KvHeadsNotDividing { .. })), "{kv:?}");
    }
    let shape = AttnShape { q, kv: q.with_seq(5).unwrap() };
    let (o, l) = be.forward_vec(&cfg, shape, &x[..64], &x[..40], &x[..40]).unwrap();
    // dk of the query's length instead of the keys'.
    let r = be.backward_vec(&cfg, shape, [&x[..64], &x[..40], &x[..40]], &o, &l, &x[..60]);
    assert!(matches!(r, Err(AttnError::ShapeMismatch { .. })));
    assert!(be.forward_vec(&cfg, shape, &x[..64], &x[..40], &x[..41]).is_err());
}
