//! The conformance files of `conformance/dilated`, `features`, `wide` and `blocks`
//! through the op on burn-flex in every dtype it stores (f32, f64, bf16, f16) and both
//! layouts: the forward on the plain flex device, the gradients by burn's autodiff
//! `backward()`. f32 and f64 are judged against the files' values within their
//! `rel_tol`, every dtype row by row against the float64 reference on the rounded inputs.

use crate::common::Layout;
use crate::common::golden_op::{BurnOp, DTYPES};
use attn_core::DType as AttnDType;
use attn_testkit::golden::{
    DilatedBackend, Forward32, GoldenCase, Gradients32, Problem, assert_attention_dirs_pass, check_case, golden_dir,
    load_dir,
};

/// Every op configuration the files run through.
fn ops() -> impl Iterator<Item = BurnOp> {
    DTYPES.into_iter().flat_map(|dtype| [Layout::Bshd, Layout::Bhsd].map(|layout| BurnOp { dtype, layout }))
}

/// The 8 files of `conformance/blocks`.
fn block_cases() -> Vec<GoldenCase> {
    let dir = golden_dir().join("blocks");
    let cases = load_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(cases.len(), 8, "the 8 block-mask files in {}", dir.display());
    cases.into_iter().map(|(path, case)| case.unwrap_or_else(|e| panic!("{}: {e}", path.display()))).collect()
}

#[test]
fn dilated_feature_and_wide_files_pass_through_the_op() {
    for op in ops() {
        assert_attention_dirs_pass(&op);
    }
}

#[test]
fn block_mask_files_pass_through_the_op() {
    let mut failed = Vec::new();
    for case in block_cases() {
        for op in ops() {
            let report = check_case(&case, Some(&op), None);
            println!("{report}");
            if !report.passed() {
                failed.push(report.to_string());
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// The op with one planted fault: dk scaled by `1 + 1e-3`.
#[derive(Debug)]
struct PlantedDk(BurnOp);

impl DilatedBackend for PlantedDk {
    fn name(&self) -> String {
        format!("{} with dk off", self.0.name())
    }
    fn dtype(&self) -> AttnDType {
        self.0.dtype()
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> attn_core::Result<Forward32> {
        self.0.forward(p, qkv)
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> attn_core::Result<Gradients32> {
        let mut g = self.0.backward(p, qkv, grad_out)?;
        g.dk.iter_mut().for_each(|x| *x *= 1.001);
        Ok(g)
    }
}

/// A dk 0.1% off fails every block file in f32 (so the check above bites on gradients).
#[test]
fn a_planted_gradient_error_fails_the_files() {
    let op = BurnOp { dtype: DTYPES[0], layout: Layout::Bshd };
    for case in block_cases() {
        let honest = check_case(&case, Some(&op), None);
        assert!(honest.passed(), "{honest}");
        let report = check_case(&case, Some(&PlantedDk(op)), None);
        assert!(!report.passed() && report.error.is_none(), "a wrong dk passed: {report}");
    }
}
