//! Cross-attention with its own key/value length on the CPU kernels (f32) equals the float64 reference layer: output, input and weight gradients, causal or not.

use std::sync::Arc;

use attn_core::{DType, DilatedConfig, Mixing};
use attn_kernels::CpuBackend;
use attn_multihead::{
    Call, Cross, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

fn bound() -> f64 {
    Tolerance::for_dtype(DType::F32).rel_l2
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn norm(x: impl Iterator<Item = f64>) -> f64 {
    x.map(|v| v * v).sum::<f64>().sqrt()
}

/// The CPU layer and the reference layer on the same f32-representable weights and
/// inputs; `query: [b, n, e]`, `key`/`value: [b, m, e]` with `m != n`.
fn check(cfg: MultiheadConfig, b: usize, n: usize, m: usize) {
    let what = format!("{:?} causal={} n={n} m={m}", cfg.attention.mixing(), cfg.attention.causal());
    let e = cfg.embed_dim;
    let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 5, Arc::new(ReferenceBackend)).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, s) in w32.params_mut().into_iter().zip(r64.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &x)| *a = x as f32);
    }
    let c32 = MultiheadDilatedAttention::from_weights(cfg, w32, Arc::new(CpuBackend::new(2).unwrap())).unwrap();
    let (q, k, v, g) =
        (random_vec(1, b * n * e), random_vec(2, b * m * e), random_vec(3, b * m * e), random_vec(4, b * n * e));
    let (y64, cache64) =
        r64.forward_train(&to64(&q), &Call::new(b, n).cross(Cross::new(&to64(&k), &to64(&v), m))).unwrap();
    let (y32, cache32) = c32.forward_train(&q, &Call::new(b, n).cross(Cross::new(&k, &v, m))).unwrap();
    let err = rel_l2_error(&y32, &y64);
    assert!(err <= bound(), "{what}: out {err:.2e}");
    let (mut g64, mut g32) = (r64.zero_grads(), c32.zero_grads());
    let d64 = r64.backward(&cache64, &to64(&g), &mut g64).unwrap();
    let d32 = c32.backward(&cache32, &g, &mut g32).unwrap();
    for (name, got, want) in [
        ("query", &d32.query, &d64.query),
        ("key", d32.key.as_ref().unwrap(), d64.key.as_ref().unwrap()),
        ("value", d32.value.as_ref().unwrap(), d64.value.as_ref().unwrap()),
    ] {
        assert_eq!(got.len(), want.len(), "{what}: d{name} length");
        let err = rel_l2_error(got, want);
        assert!(err <= bound(), "{what}: d{name} {err:.2e}");
    }
    let k_weight_norm =
        norm(g64.params().into_iter().find(|p| p.name == "k_proj.weight").unwrap().data.iter().copied());
    for (p32, p64) in g32.params().into_iter().zip(g64.params()) {
        if p32.name == "k_proj.bias" {
            // Exactly zero: each query's softmax is invariant to adding `q . b_k` to all
            // of its scores. Both must be round-off small next to the key weight gradient.
            let (got, want) = (norm(p32.data.iter().map(|&x| x as f64)), norm(p64.data.iter().copied()));
            assert!(want <= 1e-12 * k_weight_norm, "{what}: reference d k_proj.bias {want:.2e}");
            assert!(got <= bound() * k_weight_norm, "{what}: cpu d k_proj.bias {got:.2e} vs {k_weight_norm:.2e}");
            continue;
        }
        let err = rel_l2_error(p32.data, p64.data);
        assert!(err <= bound(), "{what}: d {} {err:.2e}", p32.name);
    }
}

#[test]
fn cpu_cross_attention_longer_and_shorter_keys_match_the_reference() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    check(cfg.clone(), 2, 24, 40);
    check(cfg.clone(), 1, 37, 13);
    let longnet = MultiheadConfig::new(
        16,
        2,
        DilatedConfig::builder().segments(&[8, 32]).dilations(&[1, 4]).mixing(Mixing::LongNet).build().unwrap(),
    );
    check(longnet.clone(), 1, 20, 45);
    check(longnet, 2, 45, 21);
}

/// Causal cross-attention (SPEC: keys are at global positions `0..kv_seq`; query `i`
/// sees keys `<= i`): queries past the last key see a prefix of the keys, keys past the
/// last query are never seen (zero gradients), and a query whose segment holds no key
/// outputs zero.
#[test]
fn cpu_causal_cross_attention_matches_the_reference() {
    let cfg = MultiheadConfig::new(
        16,
        4,
        DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build().unwrap(),
    );
    check(cfg.clone(), 2, 24, 40);
    check(cfg, 1, 37, 13);
    let longnet = MultiheadConfig::new(
        16,
        2,
        DilatedConfig::builder()
            .segments(&[8, 32])
            .dilations(&[1, 4])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
    );
    check(longnet.clone(), 1, 20, 45);
    check(longnet, 1, 45, 9);
}

#[test]
fn cpu_cross_attention_with_equal_lengths_is_the_self_attention_path() {
    // kv_seq == q_seq through `forward_cross` runs the self-attention kernels; still the reference.
    check(
        MultiheadConfig::new(
            16,
            4,
            DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build().unwrap(),
        ),
        1,
        30,
        30,
    );
}
