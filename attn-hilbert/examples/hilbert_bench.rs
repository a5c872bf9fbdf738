//! Prints what `cargo xtask bench --case hilbert` reports: order generation time
//! for a 1024x1024 grid and a 128x128x64 volume, permutation throughput as a
//! fraction of a plain copy, and the locality of each order.
//!
//! `cargo run --release -p attn-hilbert --example hilbert_bench`

use attn_hilbert::bench::{measure_generation, measure_permute, standard_report};
use attn_hilbert::{Grid, OrderKind, TokenOrder, locality};

fn main() -> attn_core::Result<()> {
    let grids = [Grid::new_2d(1024, 1024)?, Grid::new_3d(64, 128, 128)?];
    for grid in grids {
        for kind in OrderKind::ALL {
            let s = measure_generation(kind, grid, 5)?;
            println!(
                "generate {:<9} {grid:>11}: {:8.2} ms ({:.1} Mtokens/s)",
                kind.as_str(),
                s * 1e3,
                grid.len() as f64 / s / 1e6
            );
        }
    }
    let order = TokenOrder::hilbert_2d(128, 128)?;
    for token_len in [64, 256, 1024] {
        let t = measure_permute(&order, 1, token_len, 5)?;
        println!(
            "permute 128x128 x {token_len:>4} f32 ({:>4} MiB): copy {:5.1} GB/s, apply {:.2}, unapply {:.2}, in place {:.2} of copy",
            t.bytes >> 20,
            t.copy_gbps(),
            t.apply_fraction(),
            t.unapply_fraction(),
            t.in_place_fraction()
        );
    }
    let r = standard_report(5)?;
    println!(
        "standard: hilbert 1024x1024 {:.2} ms, 128x128x64 {:.2} ms, permute [1,16384,512] f32 {:.2} of copy ({:.1} GB/s copy)",
        r.generate_2d_s * 1e3,
        r.generate_3d_s * 1e3,
        r.permute.apply_fraction(),
        r.permute.copy_gbps()
    );
    for (h, w) in [(64, 64), (96, 80), (17, 31)] {
        for seg in [64, 256] {
            let mut line = format!("locality {h}x{w} seg {seg:>3}:");
            for kind in OrderKind::ALL {
                let m = locality(&TokenOrder::new(kind, Grid::new_2d(h, w)?)?, seg)?;
                line += &format!("  {} {:.3} / {:.1}", kind.as_str(), m.neighbour_in_segment, m.mean_segment_diameter);
            }
            println!("{line}   (neighbour-in-segment / mean diameter)");
        }
    }
    for (d, h, w, seg) in [(9, 17, 31, 64), (9, 17, 31, 512), (20, 24, 36, 512), (64, 128, 128, 4096)] {
        let mut line = format!("locality {d}x{h}x{w} seg {seg:>4}:");
        for kind in OrderKind::ALL {
            let m = locality(&TokenOrder::new(kind, Grid::new_3d(d, h, w)?)?, seg)?;
            line += &format!("  {} {:.3} / {:.1}", kind.as_str(), m.neighbour_in_segment, m.mean_segment_diameter);
        }
        println!("{line}");
    }
    Ok(())
}
