//! The `ring_plan` fuzz target run as a proptest (stable, in `cargo test`): ring problems
//! from bytes are refused, typed, or planned consistently, and small ones run on
//! in-process ranks equal to the float64 reference, sending exactly `expected_bytes`.

use attn_reliability::ring_fuzz::ring_plan;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(1000), max_shrink_iters: 500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_plan_or_fail_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        ring_plan(&bytes);
    }
}

#[test]
fn random_bytes_reach_the_ring_often_enough() {
    // The proptest above is only worth something if random bytes often make a problem
    // that runs: count how many of 1000 seeded byte strings do.
    let ran = attn_reliability::byte_cursor::seeded_hits(21, 1000, 64, ring_plan);
    println!("{ran} of 1000 byte strings ran on the ring");
    assert!(ran >= 100, "only {ran} of 1000 random byte strings ran on the ring");
}
