//! The bodies of the fuzz targets, shared by `fuzz/` (cargo fuzz) and the bytes-driven
//! proptests in `tests/`: each takes arbitrary bytes and panics only when an invariant
//! of the code under attack is broken (a panic inside that code counts too).

use std::sync::OnceLock;

use attn_core::reference;
use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4};
use attn_kernels::CpuBackend;
use attn_multihead::{MultiheadConfig, MultiheadWeights, NamedParams, load_bytes, save_bytes};
use attn_testkit::golden::{GoldenCase, check_case};
use attn_testkit::reference;
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::rel_l2_error;

use crate::byte_cursor::ByteCursor;

/// Largest q element count for which the config target also runs attention.
const RUN_LIMIT: usize = 2048;

/// Golden-file reader: any bytes give a case whose tensors match their shapes, or an error.
pub fn golden_reader(bytes: &[u8]) {
    let Ok(case) = GoldenCase::from_bytes("fuzz", bytes) else { return };
    for (name, t) in &case.tensors {
        let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        assert_eq!(numel, Some(t.data.len()), "tensor `{name}`: shape {:?} vs {} values", t.shape, t.data.len());
    }
    let _ = (case.config(), case.rel_tol(), case.causal(), case.kind());
    if let Ok(shape) = case.attn_shape() {
        assert_eq!(case.tensor("q").map(|t| t.data.len()).ok(), Some(shape.q.numel()));
        // Running a case that parsed must not panic either (a report, pass or fail).
        let _ = check_case(&case, Some(&reference()), None);
    }
}

/// The module the weights target loads into: embed 8, 2 heads, LayerNorm and biases.
pub fn small_weights() -> MultiheadWeights<f32> {
    // A fixed valid pattern: the builder cannot fail on it.
    let attention = DilatedConfig::new(&[4, 8], &[1, 2]).expect("a valid fixed pattern");
    let cfg = MultiheadConfig::new(8, 2, attention);
    MultiheadWeights::magneto(&cfg, 7)
}

/// Multihead weights reader: any bytes either load every parameter or leave the module
/// untouched; a successful load round-trips through `save_bytes`.
pub fn weights_reader(bytes: &[u8]) {
    let pristine = small_weights();
    let mut w = pristine.clone();
    match load_bytes(&mut w, bytes) {
        Err(_) => assert!(w == pristine, "a failed load changed the module"),
        Ok(()) => {
            let saved = save_bytes(&w, None).expect("saving loaded weights");
            let mut again = pristine.clone();
            load_bytes(&mut again, &saved).expect("reloading saved weights");
            let same =
                w.params().iter().zip(again.params()).all(|(a, b)| {
                    a.name == b.name && a.data.iter().zip(b.data).all(|(x, y)| x.to_bits() == y.to_bits())
                });
            assert!(same, "save/load round trip changed a parameter");
        }
    }
}

/// Largest `|scale * q.k|` over all query/key row pairs of each (batch, head), in f64.
pub fn max_abs_score(cfg: &DilatedConfig, s: Shape4, q: &[f32], k: &[f32]) -> f64 {
    let (d, scale) = (s.head_dim, cfg.scale_for(s.head_dim));
    let row = |b: usize, p: usize, h: usize| ((b * s.seq + p) * s.heads + h) * d;
    let mut m = 0.0f64;
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.seq {
                for j in 0..s.seq {
                    let (qi, kj) = (row(b, i, h), row(b, j, h));
                    let dot: f64 = (0..d).map(|e| f64::from(q[qi + e]) * f64::from(k[kj + e])).sum();
                    m = m.max((scale * dot).abs());
                }
            }
        }
    }
    m
}

/// The CPU backend's bound on `|score|`: `scale * d * max|q| * max|k|`, with the scale as
/// the f32 the kernels use, in f64.
pub fn score_bound(cfg: &DilatedConfig, s: Shape4, q: &[f32], k: &[f32]) -> f64 {
    let max_abs = |x: &[f32]| f64::from(x.iter().map(|a| a.abs()).filter(|a| a.is_finite()).fold(0.0f32, f32::max));
    let scale = f64::from(cfg.scale_for(s.head_dim) as f32);
    scale * s.head_dim as f64 * max_abs(q) * max_abs(k)
}

fn backend() -> &'static CpuBackend {
    static B: OnceLock<CpuBackend> = OnceLock::new();
    B.get_or_init(|| CpuBackend::new(1).expect("one-thread CPU backend"))
}

/// Config and shape validation from bytes. Whatever validates satisfies SPEC.md's rules;
/// small valid problems also run on the float64 reference and the CPU backend, which
/// must agree (relative L2 within 1e-4) and give finite outputs, unless the CPU backend
/// refuses, typed, what f32 cannot hold (`InvalidScale`, `ScoreOverflow`). Returns whether
/// the bytes got that far (so tests can check they are not vacuous).
pub fn config_shape(bytes: &[u8]) -> bool {
    let mut c = ByteCursor::new(bytes);
    let segs: Vec<usize> = match c.u8() % 8 {
        0 => c.sizes(),
        g => (0..usize::from(g % 3) + 1).map(|_| c.dim(24)).collect(),
    };
    let rates: Vec<usize> = match c.u8() % 8 {
        0 => c.sizes(),
        _ => segs.iter().map(|&w| 1 + usize::from(c.u8()) % w.clamp(1, 4)).collect(),
    };
    let mixing = if c.bool() { Mixing::LongNet } else { Mixing::HeadGroups };
    let causal = c.bool();
    let scale = match c.u8() % 4 {
        0 => Some(c.f64()),
        1 => Some(0.05 + f64::from(c.u8()) / 64.0),
        _ => None,
    };
    let dims: Vec<usize> = match c.u8() % 16 {
        0 => (0..usize::from(c.u8() % 6)).map(|_| c.size()).collect(),
        _ => vec![c.dim(2), c.dim(48), c.dim(4), c.dim(16)],
    };
    let kv_dims: Vec<usize> = match c.u8() % 8 {
        0 => (0..4).map(|_| c.dim(16)).collect(),
        _ => dims.clone(),
    };
    let cross = c.bool();
    // Read last, so earlier byte layouts keep their meaning: one config in eight is a
    // sliding window (and, one in four of those, also given segments: an error).
    let window =
        (c.u8() % 8 == 7).then(|| (c.dim(24).saturating_sub(1), c.dim(24).saturating_sub(1), c.u8().is_multiple_of(4)));
    let builder = match window {
        Some((left, right, also_segments)) => {
            let b = DilatedConfig::builder().window(left, right);
            if also_segments { b.segments(&segs).dilations(&rates) } else { b }
        }
        None => DilatedConfig::builder().segments(&segs).dilations(&rates).mixing(mixing),
    };
    let built = builder.causality(causal.into()).maybe_scale(scale).build();
    let shape = if cross {
        AttnShape::check_cross(&dims, &kv_dims, &kv_dims)
    } else {
        AttnShape::check(&dims, &kv_dims, &kv_dims)
    };
    if let Ok(s) = &shape {
        assert_eq!(s.q.dims().to_vec(), dims);
        assert_eq!(s.kv.dims().to_vec(), kv_dims);
        assert!(s.q.numel().checked_mul(8).is_some_and(|b| b <= isize::MAX as usize));
        assert!(cross || s.q.seq == s.kv.seq, "self-attention lengths differ");
        // Grouped-query attention: k and v may have fewer heads, dividing q's.
        assert!(s.q.batch == s.kv.batch && s.q.heads.is_multiple_of(s.kv.heads) && s.q.head_dim == s.kv.head_dim);
    }
    if Shape4::from_dims(attn_core::TensorName::Query, &dims).is_ok()
        != (dims.len() == 4
            && dims.iter().all(|&d| d > 0)
            && dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(8))
                .is_some_and(|b| b <= isize::MAX as usize))
    {
        panic!("Shape4::from_dims disagrees with the rule for {dims:?}");
    }
    let Ok(cfg) = built else { return false };
    assert_eq!(cfg.segment_lengths().len(), cfg.dilation_rates().len());
    assert_eq!(cfg.segment_lengths().is_empty(), cfg.window().is_some(), "a window and only a window has no segments");
    for (&w, &r) in cfg.segment_lengths().iter().zip(cfg.dilation_rates()) {
        assert!(w >= 1 && r >= 1 && r <= w, "validated config has w={w} r={r}");
    }
    if let Some(s) = cfg.explicit_scale() {
        assert!(s.is_finite() && s > 0.0);
    }
    let Ok(s) = shape else { return false };
    if s.q != s.kv || s.q.numel() > RUN_LIMIT || s.q.seq > 96 {
        return false;
    }
    let heads_ok = cfg.validate_heads(s.q.heads);
    assert_eq!(heads_ok.is_ok(), cfg.mixing() != Mixing::HeadGroups || s.q.heads >= cfg.num_patterns());
    for h in 0..s.q.heads.min(8) {
        for (_, p) in cfg.head_patterns(s.q.heads, h).patterns {
            assert!(p.off < p.r, "offset {} not below rate {}", p.off, p.r);
            let n = s.q.seq;
            assert_eq!(p.count_in_range(0..n), p.selected_in_range(0..n).count());
        }
    }
    let n = s.q.numel();
    let (q, k, v) = (random_vec(1, n), random_vec(2, n), random_vec(3, n));
    let to64 = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
    let want = reference::dilated_forward(&cfg, s, &to64(&q), &to64(&k), &to64(&v));
    let got = backend().forward_vec(&cfg, s.q, &q, &k, &v);
    match (want, got) {
        (Ok(want), Ok((out, lse))) => {
            // The CPU backend ran, so its bound on |score| was within f32 (see the
            // `ScoreOverflow` arm); finite outputs are asked for while every score also keeps
            // a 4x margin (the kernels work in base 2, a factor log2(e) above the score).
            if max_abs_score(&cfg, s.q, &q, &k) < f64::from(f32::MAX) / 4.0 {
                assert!(out.iter().all(|x| x.is_finite()), "non-finite output for {cfg:?} {s:?}");
            }
            // Accuracy is only asked for well-conditioned scores: with a huge scale the f32
            // scores carry absolute errors of eps * |score|, far above 1e-4 in the weights;
            // with a tiny one (found by the fuzzer: 1e-42) lse itself is an f32 subnormal
            // with a few significant bits.
            if !(1e-30..=4.0).contains(&cfg.scale_for(s.q.head_dim)) {
                return true;
            }
            let err = rel_l2_error(&out, &want.out);
            assert!(err <= 1e-4, "CPU backend differs from the reference by {err:e} for {cfg:?} {s:?}");
            let lerr = rel_l2_error(&lse, &want.lse);
            assert!(lerr <= 1e-4, "CPU lse differs from the reference by {lerr:e} for {cfg:?} {s:?}");
        }
        (Err(_), Err(_)) => {}
        // A scale valid in f64 but zero or infinite in f32: the f32 backend refuses it, typed.
        (Ok(_), Err(attn_core::AttnError::InvalidScale(sc))) => {
            let f = sc as f32;
            assert!(!(f.is_finite() && f > 0.0), "CPU backend refused the representable scale {sc:e}");
        }
        // Scores that could leave f32: the CPU backend refuses them, typed (SPEC-valid
        // and finite in f64, so the reference runs). Only when its bound really is beyond f32.
        (Ok(_), Err(attn_core::AttnError::ScoreOverflow { bound })) => {
            let want = score_bound(&cfg, s.q, &q, &k);
            assert!(want > f64::from(f32::MAX), "CPU refused scores bounded by {want:e} (fit in f32)");
            assert!(
                (bound - want).abs() <= want * 1e-9,
                "CPU reported the bound {bound:e}, not scale*d*max|q|*max|k| = {want:e}"
            );
        }
        (w, g) => panic!("reference and CPU backend disagree on validity: {:?} vs {:?}", w.err(), g.err()),
    }
    true
}
