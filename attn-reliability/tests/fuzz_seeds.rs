//! The fuzz seeds in `fuzz/seeds/` are small valid inputs (a tiny golden case computed by
//! the float64 reference, the test module's weights); this test checks they are current
//! and rewrites them when `ATTN_WRITE_SEEDS=1`.

use std::collections::HashMap;
use std::path::PathBuf;

use attn_core::reference;
use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4};
use attn_multihead::save_bytes;
use attn_reliability::fuzz_targets::{golden_reader, small_weights, weights_reader};
use attn_testkit::golden::{GoldenCase, check_case};
use attn_testkit::reference;
use attn_testkit::rng::random_vec;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn seeds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds")
}

/// A LongNet causal case of shape [1, 8, 2, 2] with every tensor a golden file holds.
fn tiny_golden() -> Vec<u8> {
    let cfg = DilatedConfig::builder().segments(&[2, 4]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    let cfg = cfg.build().unwrap();
    let s = Shape4::new(1, 8, 2, 2).unwrap();
    let n = s.numel();
    let x: Vec<Vec<f32>> = (0..4).map(|i| random_vec(70 + i, n)).collect();
    let to64 = |v: &[f32]| v.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
    let sh = AttnShape::self_attn(s);
    let f = reference::dilated_forward(&cfg, sh, &to64(&x[0]), &to64(&x[1]), &to64(&x[2])).unwrap();
    let (_, g) = reference::dilated_backward(&cfg, sh, &to64(&x[0]), &to64(&x[1]), &to64(&x[2]), &to64(&x[3])).unwrap();
    let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<_>>();
    let tensors: Vec<(&str, Vec<f32>, Vec<usize>)> = vec![
        ("q", x[0].clone(), s.dims().to_vec()),
        ("k", x[1].clone(), s.dims().to_vec()),
        ("v", x[2].clone(), s.dims().to_vec()),
        ("grad_out", x[3].clone(), s.dims().to_vec()),
        ("out", f32s(&f.out), s.dims().to_vec()),
        ("lse", f32s(&f.lse), vec![1, 8, 2]),
        ("dq", f32s(&g.dq), s.dims().to_vec()),
        ("dk", f32s(&g.dk), s.dims().to_vec()),
        ("dv", f32s(&g.dv), s.dims().to_vec()),
    ];
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, d, _)| d.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, _, shape), b)| (*name, TensorView::new(Dtype::F32, shape.clone(), b).unwrap()))
        .collect();
    let meta: HashMap<String, String> = [
        ("kind", "dilated"),
        ("mixing", "longnet"),
        ("segment_lengths", "2,4"),
        ("dilation_rates", "1,2"),
        ("causal", "true"),
        ("rel_tol", "1e-5"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

#[test]
fn fuzz_seeds_are_current_and_valid() {
    let seeds = [
        ("golden_reader/tiny_longnet_causal.safetensors", tiny_golden()),
        ("weights_reader/small_weights.safetensors", save_bytes(&small_weights(), None).unwrap()),
    ];
    let mut files = Vec::new();
    for (rel, want) in &seeds {
        let path = seeds_dir().join(rel);
        if std::env::var_os("ATTN_WRITE_SEEDS").is_some() {
            std::fs::write(&path, want).unwrap();
        }
        files.push(
            std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run with ATTN_WRITE_SEEDS=1)", path.display())),
        );
    }
    // The committed golden seed is a passing conformance case (not compared byte for byte:
    // its metadata order is a HashMap's); the weights seed is exactly the test module's
    // weights. Both pass their fuzz targets.
    let case = GoldenCase::from_bytes("seed", &files[0]).unwrap();
    let report = check_case(&case, Some(&reference()), None);
    assert!(report.passed(), "{report}");
    assert!(files[1] == seeds[1].1, "weights seed is stale (run with ATTN_WRITE_SEEDS=1)");
    golden_reader(&files[0]);
    weights_reader(&files[1]);
}
