//! The score-overflow pre-check's scan: the largest finite `|x|` of a view (NaN and
//! infinities are left to the kernels, which confine them to the rows that read them).

use attn_core::{DType, Element, TensorView};
use rayon::prelude::*;

/// The largest finite `|x|` of `x`, scanned on `pool` (rows of every batch and position
/// in parallel; AVX2 where the CPU has it).
pub(crate) fn max_finite_abs<T: Element>(pool: &rayon::ThreadPool, x: &TensorView<'_, T>) -> f64 {
    // For f32, f16 and bf16, |x| orders like the bits without the sign, and the finite
    // values are exactly those below the infinity pattern: an integer maximum the compiler
    // vectorises. f64 (the reference's type, rarely run here) compares as f64.
    let (abs_mask, inf) = match T::DTYPE {
        DType::F32 => (0x7fff_ffffu32, 0x7f80_0000u32),
        DType::F16 => (0x7fff, 0x7c00),
        DType::BF16 => (0x7fff, 0x7f80),
        DType::F64 => {
            let m = (0..x.shape().batch * x.shape().seq)
                .flat_map(|r| (0..x.shape().heads).map(move |h| (r, h)))
                .flat_map(|(r, h)| x.row(r / x.shape().seq, r % x.shape().seq, h))
                .map(|e| e.to_f64().abs())
                .filter(|a| a.is_finite())
                .fold(0.0, f64::max);
            return m;
        }
    };
    let (abs_mask, inf) = (abs_mask as i32, inf as i32);
    let s = x.shape();
    let bits = pool.install(|| {
        (0..s.batch * s.seq)
            .into_par_iter()
            .with_min_len(64)
            .map(|r| {
                let (mut acc, mut acc16) = ([0i32; 16], [0i16; 32]);
                for h in 0..s.heads {
                    crate::cpu::isa::ops::fold_row(x.row(r / s.seq, r % s.seq, h), abs_mask, inf, &mut acc, &mut acc16);
                }
                let wide = acc.into_iter().max().unwrap_or(0);
                wide.max(i32::from(acc16.into_iter().max().unwrap_or(0))) as u32
            })
            .reduce(|| 0, u32::max)
    });
    match T::DTYPE {
        DType::F16 => f64::from(half::f16::from_bits(bits as u16)),
        DType::BF16 => f64::from(half::bf16::from_bits(bits as u16)),
        _ => f64::from(f32::from_bits(bits)),
    }
}
