//! Kernel shapes on the CUDA emulation that must agree bit for bit: the forward's direct
//! path (output straight from the kernel) against its partial path, with 64 and 128 query
//! rows a block; the patterns in one launch against one launch each; the backward's
//! pipelined query tiles against its synchronous ones.
#![cfg(feature = "cuda")]

use attn_kernels::cuda::launch_plan::plan_forward;
use attn_kernels::cuda::plan::{BackwardKernel, BackwardLoads, BackwardOptions, ForwardRows, backward_kernel};
use attn_kernels::cuda::{CudaElement, ForwardPath};
use attn_testkit::golden::{Problem, assert_attention_dirs_pass, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry, conv, emulator_loading};
/// Every golden file where the direct path applies: its output and lse equal the partial
/// path's bit for bit (the same arithmetic, without the f32 round trip's merge), in bf16
/// and f16. Also counts the files, so the check cannot pass by finding none.
pub(crate) fn direct_equals_partial<T: CudaElement>(emulated: &Emulated<T>) {
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        if !emulated.direct_applies(&p) {
            continue;
        }
        let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
        let direct = emulated.forward_on(&p, [&q, &k, &v], ForwardPath::Direct).unwrap();
        let partial = emulated.forward_on(&p, [&q, &k, &v], ForwardPath::Partial).unwrap();
        let out_bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
        let lse_bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (what, d, p) in
            [("output", out_bits(&direct.0), out_bits(&partial.0)), ("lse", lse_bits(&direct.1), lse_bits(&partial.1))]
        {
            let differ: Vec<usize> = (0..d.len()).filter(|&i| d[i] != p[i]).collect();
            assert!(
                differ.is_empty() && d.len() == p.len(),
                "{}: {what}: {} of {} values differ, the first at {:?}",
                case.name,
                differ.len(),
                d.len(),
                differ.first()
            );
        }
        compared.push(case.name.clone());
    }
    println!("direct = partial bit for bit: {} files ({})", compared.len(), compared.join(", "));
    assert!(compared.len() >= 12, "only {} golden files take the direct path", compared.len());
}

#[test]
fn direct_forward_equals_the_partial_path_bf16() {
    direct_equals_partial(&Emulated::<bf16>::new(ForwardRows::M64));
}

#[test]
fn direct_forward_equals_the_partial_path_f16() {
    direct_equals_partial(&Emulated::<f16>::new(ForwardRows::M64));
}

/// The 128-row forward: every golden file (its direct path where it applies, the partial
/// path for the rest), and direct equal to partial.
#[test]
fn emulated_cuda_golden_bf16_rows_128() {
    let emulated = Emulated::<bf16>::new(ForwardRows::M128);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

/// The 128-row forward over 4 warps (two row tiles a warp): every golden file, and direct
/// equal to partial.
#[test]
fn emulated_cuda_golden_f16_rows_128w4() {
    let emulated = Emulated::<f16>::new(ForwardRows::M128W4);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

/// Every golden file whose forward fuses its patterns into fewer launches (the 64-row
/// fused kernel): the fused forward equals one launch a pattern bit for bit (each row is
/// still computed by one block with the same arithmetic), on the direct and the partial
/// path. Counts the files, so it cannot pass by fusing none.
fn fused_equals_per_pattern<T: CudaElement>() {
    let (fused, apart) = (Emulated::<T>::fused(ForwardRows::M64), Emulated::<T>::new(ForwardRows::M64));
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let launches = |e: &Emulated<T>| plan_forward(&call_geometry(&p), T::DTYPE, T::SUFFIX, e.options()).unwrap();
        let (nf, na) = (launches(&fused), launches(&apart));
        if nf.len() == na.len() {
            continue;
        }
        assert!(nf.iter().any(|l| l.params.fused > 1), "{}: fewer launches without a fused one", case.name);
        let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
        for path in [ForwardPath::Direct, ForwardPath::Partial] {
            let a = fused.forward_on(&p, [&q, &k, &v], path).unwrap();
            let b = apart.forward_on(&p, [&q, &k, &v], path).unwrap();
            let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
            let lbits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a.0) == bits(&b.0), "{} {path:?}: fused output differs", case.name);
            assert!(lbits(&a.1) == lbits(&b.1), "{} {path:?}: fused lse differs", case.name);
        }
        compared.push(format!("{} ({} -> {} launches)", case.name, na.len(), nf.len()));
    }
    println!("fused = per pattern bit for bit: {}", compared.join(", "));
    assert!(compared.len() >= 8, "only {} golden files fuse their patterns", compared.len());
}

#[test]
fn fused_patterns_equal_one_launch_a_pattern_bf16() {
    fused_equals_per_pattern::<bf16>();
}

#[test]
fn fused_patterns_equal_one_launch_a_pattern_f16() {
    fused_equals_per_pattern::<f16>();
}

/// The backward of `p` with pipelined query tiles: its dq, dk and dv accumulators equal the
/// synchronous loads' bit for bit (the same arithmetic in the same order; only when the
/// tiles arrive differs).
pub(crate) fn assert_pipelined_equals_sync<T: CudaElement>(name: &str, p: &Problem<'_>, [q, k, v, go]: [&[f32]; 4]) {
    let emulated = Emulated::<T>::new(ForwardRows::M64);
    let run = |loads| emulated.backward_accs(emulator_loading(loads), p, [q, k, v], go, None).unwrap();
    let (a, b) = (run(BackwardLoads::Pipelined), run(BackwardLoads::Sync));
    for (grad, x, y) in [("dq", &a[0], &b[0]), ("dk", &a[1], &b[1]), ("dv", &a[2], &b[2])] {
        let bits = |z: &[f32]| z.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(x) == bits(y), "{name}: pipelined {grad} differs");
    }
}

/// Every golden file whose backward runs the tensor-core kernel: pipelined = sync, bit for
/// bit. Counts the files, so it cannot pass by comparing none.
fn pipelined_equals_sync<T: CudaElement>() {
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let pipelined = BackwardOptions { loads: BackwardLoads::Pipelined, ..BackwardOptions::default() };
        let kernel = backward_kernel(T::DTYPE, T::SUFFIX, p.shape.q.head_dim, pipelined);
        if !matches!(kernel, BackwardKernel::Mma { .. }) {
            continue;
        }
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        assert_pipelined_equals_sync::<T>(&case.name, &p, [&q, &k, &v, &go]);
        compared.push(case.name.clone());
    }
    println!("pipelined backward = sync bit for bit: {}", compared.join(", "));
    assert!(compared.len() >= 12, "only {} golden files run the tensor-core backward", compared.len());
}

#[test]
fn pipelined_backward_equals_sync_bf16() {
    pipelined_equals_sync::<bf16>();
}

#[test]
fn pipelined_backward_equals_sync_f16() {
    pipelined_equals_sync::<f16>();
}
