//! Every golden file in `conformance/dilated` and `conformance/features` through the
//! ring: every strategy x layout x world size 1..=8, forward (out, lse) and gradients.

use crate::common;

use common::{RingBackend, golden_sweep};

#[test]
fn ring_matches_every_golden_file() {
    let runs = golden_sweep("dilated", 1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 9 * 8 * 2 * 3);
}

#[test]
fn ring_matches_every_feature_golden_file() {
    let runs = golden_sweep("features", 1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 9 * 8 * 2 * 3);
}
