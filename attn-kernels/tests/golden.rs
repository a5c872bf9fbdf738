//! Every golden file in `conformance/dilated`, `conformance/features` and `conformance/wide`
//! (cross-attention with keys of their own length, explicit scales, head_dim 64 and 128) (forward, lse
//! where present, dq/dk/dv) through the CPU backend: f32 on the detected and the
//! portable kernels, bf16 and f16 judged row by row against the reference on the rounded
//! inputs. The feature files cover grouped key/value heads, key padding, packed
//! sequences and sliding windows. The block-mask files (`conformance/blocks`) run in f32
//! under every ISA this CPU has, and in bf16 and f16.

use attn_core::Element;
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::Typed;
use attn_testkit::golden::{DilatedBackend, assert_attention_dirs_pass, block_case_failures};
use half::{bf16, f16};

fn run_all<T: Element>(isa: Isa) {
    assert_attention_dirs_pass(&Typed::<_, T>::new(CpuBackend::new(2).unwrap().with_isa(isa).unwrap()));
}

#[test]
fn golden_f32_detected_isa() {
    run_all::<f32>(Isa::detect());
}

#[test]
fn golden_f32_portable() {
    run_all::<f32>(Isa::Portable);
}

#[test]
fn golden_bf16() {
    run_all::<bf16>(Isa::detect());
}

#[test]
fn golden_f16() {
    run_all::<f16>(Isa::detect());
}

#[test]
fn golden_block_masks() {
    let cpu = |isa| CpuBackend::new(2).unwrap().with_isa(isa).unwrap();
    let mut backends: Vec<Box<dyn DilatedBackend>> = Isa::ALL
        .into_iter()
        .filter(|i| i.is_supported())
        .map(|i| Box::new(Typed::<_, f32>::new(cpu(i))) as Box<dyn DilatedBackend>)
        .collect();
    backends.push(Box::new(Typed::<_, bf16>::new(cpu(Isa::detect()))));
    backends.push(Box::new(Typed::<_, f16>::new(cpu(Isa::detect()))));
    let failed: Vec<String> = backends.iter().flat_map(|b| block_case_failures(b.as_ref())).collect();
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}
