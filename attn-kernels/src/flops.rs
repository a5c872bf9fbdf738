//! The FLOP model used to report speed: `4*m*m*d` per segment of `m` selected rows per
//! head and pattern (two products of `m x m x d`), halved when causal; the backward
//! counts 2.5x the forward (five products), as FlashAttention reports it.

use attn_core::{DilatedConfig, Pass, SegmentPattern, Shape4};

/// Model FLOPs of one forward (or, with `backward`, one backward) call on `shape`.
/// Closed form over segments and head offsets, so any valid shape answers at once.
pub fn model_flops(cfg: &DilatedConfig, shape: Shape4, pass: Pass) -> f64 {
    let backward = pass == Pass::Backward;
    let (heads, n) = (shape.heads, shape.seq);
    let mut squares = 0.0f64;
    for i in 0..cfg.num_patterns() {
        for (off, count) in cfg.offset_heads(heads, i).offsets() {
            squares += count as f64 * segment_squares(&cfg.pattern(i, off), n);
        }
    }
    let causal = if cfg.causal() { 0.5 } else { 1.0 };
    let bwd = if backward { 2.5 } else { 1.0 };
    4.0 * squares * shape.head_dim as f64 * causal * bwd * shape.batch as f64
}

/// Sum over the segments of `n` positions of (selected rows)^2: the full segments all
/// select the same count, the last may be shorter.
fn segment_squares(p: &SegmentPattern, n: usize) -> f64 {
    let (full, rest) = (n / p.w, n % p.w);
    let square = |s: usize| (p.count_in_segment(s, n) as f64).powi(2);
    let whole = if full > 0 { full as f64 * square(0) } else { 0.0 };
    whole + if rest > 0 { square(full) } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use attn_core::Mixing;

    use super::*;

    /// The per-head, per-segment definition the closed form replaces.
    fn walked(cfg: &DilatedConfig, shape: Shape4, backward: bool) -> f64 {
        let mut total = 0.0f64;
        for h in 0..shape.heads {
            for (_, p) in cfg.head_patterns(shape.heads, h).patterns {
                for s in 0..p.num_segments(shape.seq) {
                    let m = p.count_in_segment(s, shape.seq) as f64;
                    total += 4.0 * m * m * shape.head_dim as f64;
                }
            }
        }
        let causal = if cfg.causal() { 0.5 } else { 1.0 };
        total * causal * if backward { 2.5 } else { 1.0 } * shape.batch as f64
    }

    #[test]
    fn closed_form_equals_the_walk() {
        for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
            for (segs, rates) in [(&[8, 16, 32][..], &[1, 2, 4][..]), (&[5, 7], &[3, 7]), (&[100], &[9])] {
                for causal in [false, true] {
                    let cfg = DilatedConfig::builder()
                        .segments(segs)
                        .dilations(rates)
                        .mixing(mixing)
                        .causality(causal.into())
                        .build()
                        .unwrap();
                    for heads in cfg.num_patterns()..12 {
                        for seq in [1, 4, 5, 31, 32, 33, 99, 250] {
                            let shape = Shape4::new(2, seq, heads, 3).unwrap();
                            for pass in [Pass::Forward, Pass::Backward] {
                                let bwd = pass == Pass::Backward;
                                let (got, want) = (model_flops(&cfg, shape, pass), walked(&cfg, shape, bwd));
                                assert!((got - want).abs() <= 1e-12 * want.max(1.0), "{segs:?} {heads} {seq}");
                            }
                        }
                    }
                }
            }
        }
        // Absurd sizes answer at once (the walk took hours: 2^40 segments).
        let cfg = DilatedConfig::new(&[1], &[1]).unwrap();
        let f = model_flops(&cfg, Shape4::new(1, 1 << 40, 1 << 8, 1).unwrap(), Pass::Forward);
        assert_eq!(f, 4.0 * (1u64 << 48) as f64);
    }
}
