//! The epilogue kernels' two forms on the CPU emulation: `store_rows_v8` and
//! `delta_rows_v8` (8 values a thread, 16-byte accesses, 32-bit index math) give the bits
//! of the element-wise `store_rows` and `delta_rows`, which run where a tensor starts off a
//! 16-byte boundary (or its rows are not multiples of 8 values).
#![cfg(feature = "cuda")]

use attn_core::Shape4;
use attn_kernels::cuda::CudaElement;
use attn_testkit::rng::random_vec;
use half::{bf16, f16};

use crate::cuda_emulation::emulator;

/// `x` converted to `T` in a buffer whose element `skew` is the first of the view.
fn placed<T: CudaElement>(x: &[f32], skew: usize) -> Vec<T> {
    std::iter::repeat_n(T::default(), skew).chain(x.iter().map(|&v| T::from_f32(v))).collect()
}

fn bits<T: CudaElement>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// The store and the delta of a `[2, 37, 3, d]` tensor, written aligned and one element
/// off (a 16-bit dtype's 2 bytes, f32's 4): the same bits.
fn both_forms_agree<T: CudaElement>(d: usize) {
    let emu = emulator();
    let shape = Shape4::new(2, 37, 3, d).unwrap();
    let n = shape.numel();
    let src = random_vec(31, n);
    let store = |skew: usize| {
        let mut dst = placed::<T>(&vec![0.0; n], skew);
        // A 16-byte aligned allocation: skew 0 starts on the boundary.
        assert!(skew > 0 || (dst.as_ptr() as usize).is_multiple_of(16));
        emu.store_scaled(shape, &src, 0.75, &mut dst[skew..]).unwrap();
        bits(&dst[skew..])
    };
    let aligned = store(0);
    assert_eq!(aligned, store(1), "{} d {d}: store_rows_v8 differs from store_rows", T::SUFFIX);
    let want: Vec<u32> = src.iter().map(|&v| T::from_f32(0.75 * v).to_f32().to_bits()).collect();
    assert_eq!(aligned, want, "{} d {d}: the store is not 0.75 * src rounded once", T::SUFFIX);
    let (go, out) = (random_vec(32, n), random_vec(33, n));
    let delta = |skew: usize| {
        let (g, o) = (placed::<T>(&go, skew), placed::<T>(&out, skew));
        let d = emu.delta(shape, &g[skew..], &o[skew..], None).unwrap();
        d.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(delta(0), delta(1), "{} d {d}: delta_rows_v8 differs from delta_rows", T::SUFFIX);
}

#[test]
fn vector_epilogues_give_the_element_wise_bits() {
    for d in [8, 64, 128, 256, 12] {
        both_forms_agree::<bf16>(d);
        both_forms_agree::<f16>(d);
        both_forms_agree::<f32>(d);
    }
}
