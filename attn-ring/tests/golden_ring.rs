//! Every golden file in `conformance/dilated` through the ring: every
//! strategy x layout x world size 1..=8, forward (out, lse) and gradients.

mod common;

use common::{RingBackend, golden_sweep};

#[test]
fn ring_matches_every_golden_file() {
    let runs = golden_sweep(1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 9 * 8 * 2 * 3);
}
