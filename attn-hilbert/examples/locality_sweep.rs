//! Hilbert against Z-order over many grid sizes: how often Hilbert keeps more
//! grid neighbours inside their segment, and the mean fractions.
//!
//! `cargo run --release -p attn-hilbert --example locality_sweep -- 64,256`

use attn_hilbert::{Grid, OrderKind, TokenOrder, locality};

fn sweep(grids: &[Grid], segs: &[usize]) -> attn_core::Result<()> {
    let (mut win, mut tie, mut lose, mut sum_z, mut sum_h) = (0, 0, 0, 0.0, 0.0);
    for &g in grids {
        for &seg in segs {
            let frac = |k| {
                Ok::<_, attn_core::AttnError>(
                    locality(&TokenOrder::generate_uncached(k, g)?, seg)?.neighbour_in_segment,
                )
            };
            let (z, h) = (frac(OrderKind::ZOrder)?, frac(OrderKind::Hilbert)?);
            (sum_z, sum_h) = (sum_z + z, sum_h + h);
            match h.partial_cmp(&z) {
                Some(std::cmp::Ordering::Greater) => win += 1,
                Some(std::cmp::Ordering::Less) => lose += 1,
                _ => tie += 1,
            }
        }
    }
    let n = (win + tie + lose) as f64;
    println!(
        "rank {} segments {segs:?}: hilbert > z-order {win}, equal {tie}, less {lose}; mean fraction z-order {:.4}, hilbert {:.4}",
        grids[0].rank(),
        sum_z / n,
        sum_h / n
    );
    Ok(())
}

fn main() -> attn_core::Result<()> {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "64,256".into());
    let segs: Vec<usize> = arg.split(',').filter_map(|s| s.parse().ok()).filter(|&s| s > 0).collect();
    let mut g2 = vec![];
    for h in (8..130).step_by(7) {
        for w in (8..130).step_by(5) {
            g2.push(Grid::new_2d(h, w)?);
        }
    }
    let mut g3 = vec![];
    for d in (4..40).step_by(7) {
        for h in (5..40).step_by(6) {
            for w in (6..40).step_by(5) {
                g3.push(Grid::new_3d(d, h, w)?);
            }
        }
    }
    sweep(&g2, &segs)?;
    sweep(&g3, &segs)
}
