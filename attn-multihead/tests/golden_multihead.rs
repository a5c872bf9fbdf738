//! The `kind=multihead` conformance files (`multihead/` and `multihead_features/`:
//! grouped key/value heads and a key padding mask) through the layer on every available
//! backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_multihead::golden_case::forward_case;
use attn_multihead::{Attention, F32Tensors, LayerFloat, ReferenceBackend};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use attn_testkit::tolerance::rel_l2_error;

fn cases() -> Vec<GoldenCase> {
    let mut all = Vec::new();
    for (dir, count) in [("multihead", 2), ("multihead_features", 1)] {
        let dir = golden_dir().join(dir);
        let cases: Vec<GoldenCase> = load_dir(&dir).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
        assert_eq!(cases.len(), count, "expected the {count} files in {}", dir.display());
        all.extend(cases);
    }
    all
}

fn padding(case: &GoldenCase) -> Option<&[bool]> {
    case.key_padding.as_ref().map(|(_, _, f)| f.as_slice())
}

fn source(case: &GoldenCase) -> F32Tensors<'_> {
    let tensors: BTreeMap<String, (&[usize], &[f32])> =
        case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect();
    F32Tensors { tensors }
}

fn run<F: LayerFloat>(backend: Arc<dyn Attention<F>>, bound_floor: f64) {
    for case in cases() {
        let out = forward_case(&case.meta, &source(&case), padding(&case), backend.clone()).unwrap();
        let want = &case.tensor("out").unwrap().data;
        let err = rel_l2_error(&out, want);
        let bound = case.rel_tol().unwrap().max(bound_floor);
        assert!(err <= bound, "{} on {}: rel_l2 {err:.2e} > {bound:.0e}", case.name, backend.name());
        eprintln!("{} [{} {:?}] rel_l2 {err:.2e}", case.name, backend.name(), F::DTYPE);
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
#[cfg(feature = "ring")]
fn golden_files_pass_on_the_ring_layer_for_every_strategy_and_layout() {
    use attn_multihead::golden_case::{RingSplit, forward_case_ring};
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
