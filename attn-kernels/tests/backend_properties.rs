//! Exact properties of the CPU backend: bit-identical results for any thread count,
//! strided (fused QKV) views equal contiguous buffers bit for bit, and typed errors for
//! bad shapes and configs (never a panic).

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, DilatedConfig, Grads, Mixing, Saved, Shape4, TensorView, TensorViewMut,
};
use attn_kernels::CpuBackend;
use attn_testkit::random_vec;

fn cfg_with(mixing: Mixing, causal: bool) -> DilatedConfig {
    DilatedConfig::builder()
        .segments(&[64, 128, 256])
        .dilations(&[1, 2, 4])
        .mixing(mixing)
        .causality(causal.into())
        .build()
        .unwrap()
}

fn cfg(causal: bool) -> DilatedConfig {
    cfg_with(Mixing::LongNet, causal)
}

type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn run_all(threads: usize, cfg: &DilatedConfig, shape: Shape4) -> Run {
    let n = shape.numel();
    let (q, k, v, go) = (random_vec(11, n), random_vec(12, n), random_vec(13, n), random_vec(14, n));
    let be = CpuBackend::new(threads).unwrap();
    let (out, lse) = be.forward_vec(cfg, shape, &q, &k, &v).unwrap();
    let (dq, dk, dv) = be.backward_vec(cfg, shape, [&q, &k, &v], &out, &lse, &go).unwrap();
    (out, lse, dq, dk, dv)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn results_are_bit_identical_for_any_thread_count() {
    // Fused whole-segment backward (8+ units) and, with few units, the two-kernel one.
    let cases = [
        (Mixing::LongNet, true, Shape4::new(1, 600, 1, 32).unwrap()),
        (Mixing::LongNet, false, Shape4::new(2, 700, 3, 40).unwrap()),
        (Mixing::LongNet, true, Shape4::new(1, 1000, 2, 64).unwrap()),
        (Mixing::HeadGroups, true, Shape4::new(1, 1000, 3, 64).unwrap()),
        (Mixing::HeadGroups, false, Shape4::new(2, 333, 4, 24).unwrap()),
    ];
    for (mixing, causal, shape) in cases {
        let cfg = cfg_with(mixing, causal);
        let one = run_all(1, &cfg, shape);
        for threads in [2, 3] {
            let many = run_all(threads, &cfg, shape);
            assert_eq!(bits(&one.0), bits(&many.0), "out, {threads} threads");
            assert_eq!(bits(&one.1), bits(&many.1), "lse, {threads} threads");
            assert_eq!(bits(&one.2), bits(&many.2), "dq, {threads} threads");
            assert_eq!(bits(&one.3), bits(&many.3), "dk, {threads} threads");
            assert_eq!(bits(&one.4), bits(&many.4), "dv, {threads} threads");
        }
    }
}

#[test]
fn fused_qkv_and_strided_output_equal_contiguous() {
    let shape = Shape4::new(2, 300, 3, 24).unwrap();
    let (b, s, h, d) = (shape.batch, shape.seq, shape.heads, shape.head_dim);
    let fused = random_vec(21, 3 * shape.numel());
    // Contiguous copies of the q, k, v parts of the fused [b, s, 3, h, d] buffer.
    let part = |p: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(shape.numel());
        for bs in 0..b * s {
            out.extend_from_slice(&fused[(bs * 3 + p) * h * d..(bs * 3 + p + 1) * h * d]);
        }
        out
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let go = random_vec(22, shape.numel());
    let cfg = cfg(true);
    let be = CpuBackend::new(2).unwrap();
    let (out, lse) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
    let (dq, dk, dv) = be.backward_vec(&cfg, shape, [&q, &k, &v], &out, &lse, &go).unwrap();

    let [qv, kv, vv] = TensorView::fused_qkv(&fused, shape).unwrap();
    // Output into a padded buffer: rows of `h * d + 8` elements.
    let row = h * d + 8;
    let strides = [s * row, row, d, 1];
    let mut out_buf = vec![f32::NAN; b * s * row];
    let mut lse2 = vec![0.0f32; shape.lse_len()];
    let ov = TensorViewMut::strided(TensorName::Output, &mut out_buf, shape, strides).unwrap();
    be.forward(&AttnInputs::new(&cfg, qv, kv, vv), ov, &mut lse2).unwrap();
    let ov = TensorView::strided(TensorName::Output, &out_buf, shape, strides).unwrap();
    assert_eq!(bits(&ov.to_f64_vec().iter().map(|&x| x as f32).collect::<Vec<_>>()), bits(&out));
    assert_eq!(bits(&lse2), bits(&lse));
    // Padding untouched.
    assert!(out_buf.chunks(row).all(|r| r[h * d..].iter().all(|x| x.is_nan())));

    // Backward from strided views, gradients into one fused [b, s, 3, h, d] buffer.
    let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape).unwrap();
    // Gradients written through [b, s, 3, h, d] strides, one buffer per gradient.
    let gstrides = [s * 3 * h * d, 3 * h * d, d, 1];
    let total = 3 * shape.numel();
    let mut gq_buf = vec![0.0f32; total];
    let mut gk_buf = vec![0.0f32; total];
    let mut gv_buf = vec![0.0f32; total];
    let dqv = TensorViewMut::strided(TensorName::GradQuery, &mut gq_buf, shape, gstrides).unwrap();
    let dkv = TensorViewMut::strided(TensorName::GradKey, &mut gk_buf[h * d..], shape, gstrides).unwrap();
    let dvv = TensorViewMut::strided(TensorName::GradValue, &mut gv_buf[2 * h * d..], shape, gstrides).unwrap();
    let grads = Grads { dq: dqv, dk: dkv, dv: dvv };
    be.backward(&AttnInputs::new(&cfg, qv, kv, vv), Saved { out: ov, lse: &lse2 }, gov, grads).unwrap();
    let gather = |buf: &[f32], p: usize| -> Vec<f32> {
        let mut out = Vec::new();
        for bs in 0..b * s {
            out.extend_from_slice(&buf[(bs * 3 + p) * h * d..(bs * 3 + p + 1) * h * d]);
        }
        out
    };
    assert_eq!(bits(&gather(&gq_buf, 0)), bits(&dq));
    assert_eq!(bits(&gather(&gk_buf, 1)), bits(&dk));
    assert_eq!(bits(&gather(&gv_buf, 2)), bits(&dv));
}

#[test]
fn bad_shapes_are_typed_errors() {
    let be = CpuBackend::new(1).unwrap();
    let cfg = DilatedConfig::new(&[4, 8], &[1, 2]).unwrap();
    let s = Shape4::new(1, 8, 2, 4).unwrap();
    let x = vec![0.5f32; s.numel()];
    // Too few heads for two head groups.
    let s1 = Shape4::new(1, 8, 1, 4).unwrap();
    assert!(matches!(be.forward_vec(&cfg, s1, &x[..32], &x[..32], &x[..32]), Err(AttnError::TooFewHeads { .. })));
    // Buffer length disagrees with the shape.
    assert!(matches!(be.forward_vec(&cfg, s, &x[..63], &x, &x), Err(AttnError::ShapeMismatch { .. })));
    // k and v of different sequence lengths (k and v always share a shape).
    let qv = TensorView::contiguous(TensorName::Query, &x, s).unwrap();
    let s2 = Shape4::new(1, 4, 2, 4).unwrap();
    let kv = TensorView::contiguous(TensorName::Key, &x[..32], s2).unwrap();
    let mut out = vec![0.0f32; s.numel()];
    let mut lse = vec![0.0f32; s.lse_len()];
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
    assert!(matches!(
        be.forward(&AttnInputs::new(&cfg, qv, kv, qv), ov, &mut lse),
        Err(AttnError::ShapeMismatch { .. })
    ));
    // Output of another shape, LSE of the wrong length.
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut out[..32], s2).unwrap();
    assert!(matches!(
        be.forward(&AttnInputs::new(&cfg, qv, qv, qv), ov, &mut lse),
        Err(AttnError::ShapeMismatch { .. })
    ));
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
    let r = be.forward(&AttnInputs::new(&cfg, qv, qv, qv), ov, &mut lse[..15]);
    assert!(matches!(r, Err(AttnError::ShapeMismatch { .. })));
    // Backward: wrong LSE length and grad_out shape.
    let (o, l) = be.forward_vec(&cfg, s, &x, &x, &x).unwrap();
    assert!(be.backward_vec(&cfg, s, [&x, &x, &x], &o, &l[..15], &x).is_err());
    assert!(be.backward_vec(&cfg, s, [&x, &x, &x], &o, &l, &x[..60]).is_err());
    // A scale that is positive in f64 but zero in f32.
    let tiny = DilatedConfig::builder().segments(&[4]).dilations(&[1]).scale(1e-300).build().unwrap();
    assert!(matches!(be.forward_vec(&tiny, s, &x, &x, &x), Err(AttnError::InvalidScale(_))));
}

/// Causal: a NaN/Inf in a value row never reaches rows that do not read it, forward and
/// backward (a masked weight is 0 and `0 * NaN` would be NaN), and a NaN in a query row
/// makes its own output NaN (never silently dropped).
#[test]
fn poison_stays_in_the_rows_that_read_it() {
    let cfg = DilatedConfig::builder().segments(&[16]).dilations(&[1]).causal().build().unwrap();
    let shape = Shape4::new(1, 64, 1, 8).unwrap();
    let n = shape.numel();
    let (q, k, v, go) = (random_vec(41, n), random_vec(42, n), random_vec(43, n), random_vec(44, n));
    let be = CpuBackend::new(2).unwrap();
    let run = |q: &[f32], v: &[f32]| {
        let (out, lse) = be.forward_vec(&cfg, shape, q, &k, v).unwrap();
        let (dq, dk, dv) = be.backward_vec(&cfg, shape, [q, &k, v], &out, &lse, &go).unwrap();
        (out, dq, dk, dv)
    };
    let clean = run(&q, &v);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut vp = v.clone();
        vp[50 * 8 + 3] = bad; // value row of position 50 (segment 48..64)
        let hit = run(&q, &vp);
        let rows = |x: &[f32], r: std::ops::Range<usize>| bits(&x[r.start * 8..r.end * 8]);
        // Positions 48, 49 do not read key 50; segments 0..48 are independent.
        assert_eq!(rows(&hit.0, 0..50), rows(&clean.0, 0..50), "out, {bad}");
        assert_eq!(rows(&hit.1, 0..50), rows(&clean.1, 0..50), "dq, {bad}");
        assert_eq!(rows(&hit.2, 0..48), rows(&clean.2, 0..48), "dk, {bad}");
        assert_eq!(rows(&hit.3, 0..48), rows(&clean.3, 0..48), "dv, {bad}");
        assert!(hit.0[50 * 8..51 * 8].iter().any(|x| !x.is_finite()), "row 50 reads the poison");
    }
    let mut qp = q.clone();
    qp[20 * 8] = f32::NAN;
    let hit = run(&qp, &v);
    assert!(hit.0[20 * 8..21 * 8].iter().all(|x| x.is_nan()), "a NaN query gives a NaN output row");
    assert_eq!(bits(&hit.0[..20 * 8]), bits(&clean.0[..20 * 8]));
}

/// The forward's unit lengths depend on the shape (fewer than 16 units halve them), but
/// no row's result does: one batch element alone (short units) equals the same element
/// inside a batch of 8 (long units), bit for bit, both mixings, causal or not.
#[test]
fn forward_rows_do_not_depend_on_unit_lengths() {
    let be = CpuBackend::new(2).unwrap();
    for (mixing, causal) in [(Mixing::LongNet, true), (Mixing::LongNet, false), (Mixing::HeadGroups, true)] {
        let cfg =
            DilatedConfig::builder().segments(&[700, 2048]).dilations(&[1, 3]).mixing(mixing).causality(causal.into());
        let cfg = cfg.build().unwrap();
        let heads = if mixing == Mixing::HeadGroups { 2 } else { 1 };
        let (one, eight) = (Shape4::new(1, 2100, heads, 24).unwrap(), Shape4::new(8, 2100, heads, 24).unwrap());
        let x: Vec<Vec<f32>> = (0..3).map(|i| random_vec(40 + i, eight.numel())).collect();
        let (all, all_lse) = be.forward_vec(&cfg, eight, &x[0], &x[1], &x[2]).unwrap();
        let (n, l) = (one.numel(), one.lse_len());
        let b = 5;
        let part = |v: &Vec<f32>| v[b * n..(b + 1) * n].to_vec();
        let (single, single_lse) = be.forward_vec(&cfg, one, &part(&x[0]), &part(&x[1]), &part(&x[2])).unwrap();
        assert!(single == all[b * n..(b + 1) * n], "{mixing:?} causal={causal}: out differs");
        assert!(single_lse == all_lse[b * l..(b + 1) * l], "{mixing:?} causal={causal}: lse differs");
    }
}
