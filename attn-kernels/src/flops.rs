//! The FLOP model used to report speed: `4*m*m*d` per segment of `m` selected rows per
//! head and pattern (two products of `m x m x d`), halved when causal; the backward
//! counts 2.5x the forward (five products), as FlashAttention reports it.

use attn_core::{DilatedConfig, Shape4};

/// Model FLOPs of one forward (or, with `backward`, one backward) call on `shape`.
pub fn model_flops(cfg: &DilatedConfig, shape: Shape4, backward: bool) -> f64 {
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
    let bwd = if backward { 2.5 } else { 1.0 };
    total * causal * bwd * shape.batch as f64
}
