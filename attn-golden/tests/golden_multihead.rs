//! The `kind=multihead` conformance files (`multihead/`, `multihead_features/`:
//! grouped key/value heads and a key padding mask, `multihead_qkln/`: the qk-LN layout)
//! through the layer on every available backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_golden::forward_case;
use attn_multihead::{Attention, F32Tensors, LayerFloat, ReferenceBackend};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use attn_testkit::tolerance::rel_l2_error;

fn cases() -> Vec<GoldenCase> {
    let mut all = Vec::new();
    for (dir, count) in [("multihead", 2), ("multihead_features", 1), ("multihead_qkln", 2)] {
        let dir = golden_dir().join(dir);
        let cases: Vec<GoldenCase> = load_dir(&dir).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
        assert_eq!(cases.len(), count, "expected the {count} files in {}", dir.display());
        all.extend(cases);
    }
    all
}

fn padding(case: &GoldenCase) -> Option<&[bool]> {
    case.masks.key_padding().map(|k| k.view().flags())
}

fn source(case: &GoldenCase) -> F32Tensors<'_> {
    let tensors: BTreeMap<String, (&[usize], &[f32])> =
        case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect();
    F32Tensors { tensors }
}

/// The layer's output on `case` (through `backend`) judged against the file's `out`: its
/// relative L2 error, or a message where it exceeds the file's bound (at least `bound_floor`).
fn judge<F: LayerFloat>(case: &GoldenCase, backend: Arc<dyn Attention<F>>, bound_floor: f64) -> Result<f64, String> {
    let out = forward_case(&case.meta, &source(case), padding(case), backend.clone()).map_err(|e| e.to_string())?;
    let want = &case.tensor("out").map_err(|e| e.to_string())?.data;
    let err = rel_l2_error(&out, want);
    let bound = case.rel_tol().map_err(|e| e.to_string())?.max(bound_floor);
    if err <= bound {
        Ok(err)
    } else {
        Err(format!("{} on {}: rel_l2 {err:.2e} > {bound:.0e}", case.name, backend.name()))
    }
}

fn run<F: LayerFloat>(backend: Arc<dyn Attention<F>>, bound_floor: f64) {
    for case in cases() {
        let err = judge(&case, backend.clone(), bound_floor).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{} [{} {:?}] rel_l2 {err:.2e}", case.name, backend.name(), F::DTYPE);
    }
}

/// The judge bites on every file: an expected output with one value off by 1e-2, and a
/// layer with one weight off by 1e-2, are both rejected (the f64 reference, whose own
/// answer passes far inside the bound).
#[test]
fn planted_errors_in_the_expected_output_or_the_layer_are_rejected() {
    for case in cases() {
        let mut wrong_want = case.clone();
        let out = &mut wrong_want.tensors.get_mut("out").expect("an out tensor").data;
        let mid = out.len() / 2;
        out[mid] += 1e-2;
        let e = judge::<f64>(&wrong_want, Arc::new(ReferenceBackend), 0.0).expect_err("a wrong out passed");
        eprintln!("planted out error: {e}");
        let mut wrong_layer = case.clone();
        let name = wrong_layer.tensors.keys().find(|k| k.ends_with("weight") && !k.contains("norm")).cloned();
        let name = name.unwrap_or_else(|| panic!("{}: no projection weight", case.name));
        wrong_layer.tensors.get_mut(&name).expect("the weight").data[0] += 1e-2;
        let e = judge::<f64>(&wrong_layer, Arc::new(ReferenceBackend), 0.0).expect_err("a wrong layer passed");
        eprintln!("planted {name} error: {e}");
    }
}

#[test]
fn golden_files_pass_on_the_reference_in_f64() {
    run::<f64>(Arc::new(ReferenceBackend), 0.0);
}

#[test]
fn golden_files_pass_on_the_reference_in_f32() {
    run::<f32>(Arc::new(ReferenceBackend), 0.0);
}

#[test]
fn golden_files_pass_on_the_cpu_kernels() {
    let cpu = Arc::new(attn_kernels::CpuBackend::new(2).unwrap());
    run::<f32>(cpu.clone(), 0.0);
    run::<f64>(cpu, 0.0);
}

#[test]
fn golden_files_pass_on_the_ring_layer_for_every_strategy_and_layout() {
    use attn_golden::{RingSplit, forward_case_ring};
    use attn_ring::{Layout, Strategy};
    for case in cases() {
        let want = &case.tensor("out").unwrap().data;
        let bound = case.rel_tol().unwrap();
        for (world, layout, strategy) in [
            (2, Layout::Contiguous, Strategy::Auto),
            (3, Layout::Contiguous, Strategy::Ring),
            (2, Layout::Zigzag, Strategy::AllGather),
            (4, Layout::Zigzag, Strategy::Ring),
        ] {
            let split = RingSplit { world, layout, strategy };
            let out = forward_case_ring(&case.meta, &source(&case), padding(&case), split).unwrap();
            let err = rel_l2_error(&out, want);
            assert!(err <= bound, "{} p={world} {layout:?} {strategy:?}: {err:.2e}", case.name);
        }
    }
}
