//! The gradient into the LSE as callers hand it over: a wrong length is a typed error
//! naming `grad_lse` (CPU and reference alike); with the finite check on, a NaN on a row
//! that attends nothing is accepted and changes nothing, one on a row that attends
//! something is refused with its index; the CPU kernels on rows that attend nothing.

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{Attention, AttnError, AttnInputs, Grads, ReferenceBackend, Saved, TensorView, TensorViewMut};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::golden::DilatedBackend;
use attn_testkit::{FeatureCase, Typed, judge_lse_gradients, unattended_rows_case};
use half::{bf16, f16};

/// `[dq, dk, dv]` of `case` through `backend`, with `grad_lse`.
fn gradients(backend: &dyn Attention<f32>, case: &FeatureCase, grad_lse: &[f32]) -> attn_core::Result<[Vec<f32>; 3]> {
    let (shape, masks) = (case.shape, case.masks());
    let [q, k, v, go] = case.inputs();
    let inputs = AttnInputs::contiguous(&case.cfg, shape, [&q, &k, &v])?.with_masks(masks);
    let (mut out, mut lse) = (vec![0.0f32; shape.q.numel()], vec![0.0f32; shape.q.lse_len()]);
    backend.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?, &mut lse)?;
    let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, shape.q)?, lse: &lse };
    let gv = TensorView::contiguous(TensorName::GradOutput, &go, shape.q)?;
    let mut g = [vec![0.0f32; shape.q.numel()], vec![0.0f32; shape.kv.numel()], vec![0.0f32; shape.kv.numel()]];
    let [dq, dk, dv] = &mut g;
    backend.backward_with_lse_grad(&inputs, saved, gv, Some(grad_lse), Grads::contiguous(shape, [dq, dk, dv])?)?;
    Ok(g)
}

/// The LSE of `case` (f32, through the CPU kernels).
fn lse_of(case: &FeatureCase) -> Vec<f32> {
    let [q, k, v, _] = case.inputs();
    let inputs = AttnInputs::contiguous(&case.cfg, case.shape, [&q, &k, &v]).unwrap().with_masks(case.masks());
    let mut out = vec![0.0f32; case.shape.q.numel()];
    let mut lse = vec![0.0f32; case.shape.q.lse_len()];
    let view = TensorViewMut::contiguous(TensorName::Output, &mut out, case.shape.q).unwrap();
    CpuBackend::new(1).unwrap().forward(&inputs, view, &mut lse).unwrap();
    lse
}

#[test]
fn a_grad_lse_of_the_wrong_length_is_a_typed_error() {
    let case = unattended_rows_case();
    let n = case.shape.q.lse_len();
    let backends: [Box<dyn Attention<f32>>; 2] = [Box::new(CpuBackend::new(1).unwrap()), Box::new(ReferenceBackend)];
    for be in &backends {
        for len in [n - 1, n + 1] {
            match gradients(be.as_ref(), &case, &vec![0.0; len]) {
                Err(AttnError::ShapeMismatch { tensor: TensorName::GradLse, expected, got }) => {
                    assert_eq!((expected, got), (vec![n], vec![len]), "{}", be.name())
                }
                other => panic!("{} with {len} values: {:?}", be.name(), other.map(|_| ())),
            }
        }
    }
}

#[test]
fn the_finite_check_judges_grad_lse_only_where_a_row_attends() {
    let case = unattended_rows_case();
    let lse = lse_of(&case);
    let unattended: Vec<usize> = (0..lse.len()).filter(|&i| lse[i] == f32::NEG_INFINITY).collect();
    let attended = (0..lse.len()).find(|&i| lse[i].is_finite()).unwrap();
    assert!(!unattended.is_empty(), "the case has no row that attends nothing");
    let checked = CpuBackend::new(2).unwrap().with_check_finite(FiniteCheck::Inputs);
    let zeros = vec![0.0f32; lse.len()];
    let mut nan_there = zeros.clone();
    unattended.iter().for_each(|&i| nan_there[i] = f32::NAN);
    let want = gradients(&checked, &case, &zeros).unwrap();
    let got = gradients(&checked, &case, &nan_there).unwrap();
    assert_eq!(got, want, "a NaN on rows that attend nothing changed the gradients");
    let mut nan_attended = zeros;
    nan_attended[attended] = f32::NAN;
    match gradients(&checked, &case, &nan_attended) {
        Err(AttnError::NonFinite { tensor: TensorName::GradLse, index }) => assert_eq!(index, attended),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// The CPU kernels in every dtype on rows that attend nothing (NaN gradients into their
/// LSE, which the judge puts there).
#[test]
fn cpu_lse_gradients_on_rows_that_attend_nothing() {
    let case = unattended_rows_case();
    let cpu = || CpuBackend::new(2).unwrap();
    let backends: [Box<dyn DilatedBackend>; 4] = [
        Box::new(Typed::<_, f32>::new(cpu())),
        Box::new(Typed::<_, f32>::new(cpu().with_isa(Isa::Portable).unwrap())),
        Box::new(Typed::<_, bf16>::new(cpu())),
        Box::new(Typed::<_, f16>::new(cpu())),
    ];
    for b in &backends {
        judge_lse_gradients(b.as_ref(), &case).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
    }
}
