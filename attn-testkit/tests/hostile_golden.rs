//! The golden reader rejects truncated, lying and random files with errors, never panics.

use attn_testkit::golden::{GoldenCase, golden_dir};
use proptest::prelude::*;

fn real_file() -> Vec<u8> {
    std::fs::read(golden_dir().join("dilated/hg_basic.safetensors")).expect("golden file")
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = real_file();
    assert!(GoldenCase::from_bytes("full", &bytes).is_ok());
    for cut in (0..bytes.len()).step_by(37).chain([bytes.len() - 1]) {
        assert!(GoldenCase::from_bytes("cut", &bytes[..cut]).is_err(), "truncated at {cut} accepted");
    }
}

#[test]
fn lying_headers_are_errors() {
    let bytes = real_file();
    // Header length claiming far more than the file holds.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(GoldenCase::from_bytes("huge", &huge).is_err());
    // A tensor whose declared offsets exceed the data.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let lied = header.replacen("\"data_offsets\":[0,", "\"data_offsets\":[1,", 1);
    if lied != header {
        let mut b = (lied.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(lied.as_bytes());
        b.extend_from_slice(&bytes[8 + n..]);
        assert!(GoldenCase::from_bytes("lied", &b).is_err());
    }
    // Wrong dtype: F32 relabelled F16 (the sizes then disagree, or the dtype is refused).
    let relabel = header.replace("\"F32\"", "\"F16\"");
    let mut b = (relabel.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(relabel.as_bytes());
    b.extend_from_slice(&bytes[8 + n..]);
    assert!(GoldenCase::from_bytes("dtype", &b).is_err());
}

#[test]
fn unknown_kind_and_bad_metadata_are_errors() {
    let bytes = real_file();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    for (from, to) in [("\"dilated\"", "\"weird\""), ("\"1,2,4\"", "\"1,x,4\"")] {
        let h = header.replacen(from, to, 1);
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(&bytes[8 + n..]);
        let case = GoldenCase::from_bytes("meta", &b);
        assert!(case.is_err() || case.unwrap().config().is_err(), "{from} -> {to} accepted");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(512), ..ProptestConfig::default() })]
    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        // Random bytes are (overwhelmingly) not a safetensors file with `kind` metadata.
        prop_assert!(GoldenCase::from_bytes("random", &bytes).is_err());
    }

    #[test]
    fn flipped_bytes_never_panic(pos in any::<prop::sample::Index>(), val: u8) {
        let mut bytes = real_file();
        let i = pos.index(bytes.len());
        bytes[i] = val;
        // Either an error, or a case whose every tensor is consistent with its shape.
        if let Ok(case) = GoldenCase::from_bytes("flip", &bytes) {
            for t in case.tensors.values() {
                prop_assert_eq!(t.shape.iter().product::<usize>(), t.data.len());
            }
            let _ = case.config();
            let _ = case.attn_shape();
        }
    }
}

/// `blocks/NAME` with its header's first `from` replaced by `to`.
fn edited_block_file(name: &str, from: &str, to: &str) -> Vec<u8> {
    let bytes = std::fs::read(golden_dir().join("blocks").join(name)).expect("golden file");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let h = header.replacen(from, to, 1);
    assert_ne!(h, header, "{name}: `{from}` not in the header");
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(h.as_bytes());
    b.extend_from_slice(&bytes[8 + n..]);
    b
}

/// A stated `block_pattern` one parameter away from the one that built the file's mask,
/// or a block mask relabelled as another dtype, is a format error naming it.
#[test]
fn a_block_pattern_that_does_not_build_the_mask_is_an_error() {
    let edits = [
        ("bs_local_window.safetensors", "window_blocks=3", "window_blocks=5", "differs"),
        ("bs_varlen.safetensors", "window_blocks=5", "window_blocks=3", "differs"),
        ("bs_global_local_causal.safetensors", "radius=2", "radius=1", "differs"),
        ("bs_dilated_sparse_ragged.safetensors", "rates=1,2,4", "rates=1,2,3", "differs"),
        ("bs_local_window.safetensors", "window_blocks=3", "window_blocks=3 radius=1", "not a parameter"),
        ("bs_local_window.safetensors", "\"U8\"", "\"I8\"", "block_mask"),
    ];
    for (name, from, to, want) in edits {
        let original = std::fs::read(golden_dir().join("blocks").join(name)).unwrap();
        assert!(GoldenCase::from_bytes(name, &original).is_ok(), "{name}");
        match GoldenCase::from_bytes(name, &edited_block_file(name, from, to)) {
            Ok(_) => panic!("{name}: {from} -> {to} accepted"),
            Err(e) => assert!(e.to_string().contains(want), "{name}: {from} -> {to}: {e}"),
        }
    }
}
