//! Ring message framing under attack: every single-bit flip and every truncation of a
//! sealed frame is detected by `Framing::open`, lying length fields are errors, and
//! random bytes never panic.

use attn_ring::comm::{Framing, HEADER_BYTES};
use proptest::prelude::*;

fn sealed(len: usize) -> (Framing, Vec<u8>, Vec<u8>) {
    let mut tx = Framing::new(2, 4);
    let _ = tx.seal(1, vec![7u8; 3]); // advance the channel: sequence 1 is the one attacked
    let payload: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
    let frame = tx.seal(1, payload.clone());
    let mut rx = Framing::new(1, 4);
    let first = Framing::new(2, 4).seal(1, vec![7u8; 3]);
    rx.open(2, first).expect("first frame");
    (rx, frame, payload)
}

#[test]
fn every_single_bit_flip_is_detected() {
    for len in [0usize, 1, 7, 8, 9, 64, 101] {
        let (rx, frame, payload) = sealed(len);
        assert_eq!(rx.clone().open(2, frame.clone()).expect("clean frame"), payload);
        for bit in 0..frame.len() * 8 {
            let mut bad = frame.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(rx.clone().open(2, bad).is_err(), "payload {len} B: flip of bit {bit} went undetected");
        }
    }
}

#[test]
fn every_truncation_and_extension_is_detected() {
    let (rx, frame, _) = sealed(64);
    for cut in 0..frame.len() {
        assert!(rx.clone().open(2, frame[..cut].to_vec()).is_err(), "truncation to {cut} accepted");
    }
    let mut longer = frame.clone();
    longer.push(0);
    assert!(rx.clone().open(2, longer).is_err());
    // A length field claiming u64::MAX (or any wrong value) is an error, not an allocation.
    for claimed in [u64::MAX, 1 << 40, 63, 65] {
        let mut bad = frame.clone();
        bad[16..24].copy_from_slice(&claimed.to_le_bytes());
        assert!(rx.clone().open(2, bad).is_err(), "length {claimed} accepted");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(2000), ..ProptestConfig::default() })]

    #[test]
    fn random_frames_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..160), peer in 0..4usize) {
        let mut rx = Framing::new(1, 4);
        prop_assume!(peer != 1);
        let r = rx.open(peer, bytes.clone());
        // Only a frame carrying the magic word, its sender, the expected sequence, its
        // length and a matching checksum opens; random bytes essentially never do.
        if bytes.len() >= HEADER_BYTES {
            prop_assert!(r.is_err());
        }
    }
}
