//! Hostile safetensors files against both readers (golden cases, multihead weights):
//! truncated, wrong dtypes, lying headers, huge declared sizes and random bytes must be
//! errors, never panics, and must never allocate the size a header merely declares.

use attn_multihead::{MultiheadWeights, load_bytes, save_bytes};
use attn_reliability::counting_alloc::{self, CountingAlloc, measure};
use attn_reliability::fuzz_targets::{golden_reader, small_weights, weights_reader};
use attn_testkit::golden::{GoldenCase, golden_dir};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// A safetensors file from a JSON header and a data section.
fn file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

fn golden_bytes() -> Vec<u8> {
    std::fs::read(golden_dir().join("dilated/hg_basic.safetensors")).expect("golden file hg_basic")
}

fn weights_bytes() -> Vec<u8> {
    save_bytes(&small_weights(), None).expect("save small weights")
}

/// Split a file into its header text and data section.
fn split(bytes: &[u8]) -> (String, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (String::from_utf8(bytes[8..8 + n].to_vec()).unwrap(), bytes[8 + n..].to_vec())
}

/// Both readers reject `bytes` (the weights reader leaving its module untouched), with
/// no single allocation above `limit` bytes. Callers hold `counting_alloc::exclusive()`
/// for their whole body, so no other test allocates while this one measures.
fn both_reject(what: &str, bytes: &[u8], limit: usize) {
    let pristine = small_weights();
    let (res, m) = measure(|| {
        let golden = GoldenCase::from_bytes("hostile", bytes).err().map(|e| e.to_string());
        let mut w = pristine.clone();
        let weights = load_bytes(&mut w, bytes).err().map(|e| e.to_string());
        (golden, weights, w == pristine)
    });
    let (golden, weights, untouched) = res;
    assert!(golden.is_some(), "{what}: golden reader accepted it");
    assert!(weights.is_some(), "{what}: weights reader accepted it");
    assert!(untouched, "{what}: failed weights load changed the module");
    assert!(m.largest <= limit, "{what}: largest allocation {} bytes exceeds {limit}", m.largest);
}

/// Generous bound on a single allocation while reading a `len`-byte file: a few copies.
fn bound(len: usize) -> usize {
    8 * len + (64 << 10)
}

#[test]
fn huge_declared_shapes_are_refused_without_allocating_them() {
    let _g = counting_alloc::exclusive();
    let cases = [
        // 2^62 elements declared, 16 bytes present.
        r#"{"q":{"dtype":"F32","shape":[2147483648,2147483648],"data_offsets":[0,16]}}"#,
        // Element count overflows u64.
        r#"{"q":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,16]}}"#,
        // Offsets far beyond the file.
        r#"{"q":{"dtype":"F32","shape":[268435456],"data_offsets":[0,1073741824]}}"#,
        // End before start.
        r#"{"q":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}"#,
        // Negative and fractional numbers where sizes belong.
        r#"{"q":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}"#,
        r#"{"q":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}}"#,
        // Two tensors sharing bytes.
        r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
    ];
    for h in cases {
        let b = file(h, &[0u8; 16]);
        both_reject(h, &b, bound(b.len()));
    }
}

#[test]
fn lying_header_lengths_are_refused() {
    let _g = counting_alloc::exclusive();
    let good = weights_bytes();
    for claimed in [u64::MAX, u64::MAX / 2, 1 << 40, (good.len() - 7) as u64, 0, 1] {
        let mut b = good.clone();
        b[..8].copy_from_slice(&claimed.to_le_bytes());
        both_reject(&format!("header length {claimed}"), &b, bound(b.len()));
    }
    for h in ["", "{", "[]", "null", "{\"q\":1}", "\u{0}\u{0}\u{0}", "{\"__metadata__\":{\"kind\":1}}"] {
        let b = file(h, &[]);
        both_reject(&format!("header {h:?}"), &b, bound(b.len()));
    }
    let mut not_utf8 = file("{\"a\":\"xx\"}", &[]);
    not_utf8[12] = 0xff;
    both_reject("non-UTF-8 header", &not_utf8, bound(not_utf8.len()));
}

#[test]
fn every_truncation_of_either_file_is_refused() {
    let _g = counting_alloc::exclusive();
    for (name, bytes) in [("golden", golden_bytes()), ("weights", weights_bytes())] {
        for cut in (0..bytes.len()).step_by(13).chain([bytes.len() - 1]) {
            let b = &bytes[..cut];
            assert!(GoldenCase::from_bytes("cut", b).is_err(), "{name} cut at {cut}: golden reader accepted it");
            let pristine = small_weights();
            let mut w = pristine.clone();
            assert!(load_bytes(&mut w, b).is_err(), "{name} cut at {cut}: weights reader accepted it");
            assert!(w == pristine, "{name} cut at {cut}: module changed");
        }
    }
}

#[test]
fn wrong_dtypes_are_refused() {
    let _g = counting_alloc::exclusive();
    let (header, data) = split(&weights_bytes());
    for dt in ["I32", "U32", "I64", "F64", "F16", "U8", "BOOL", "F8_E4M3", "X99"] {
        // Same bytes relabelled: the size no longer matches, or the dtype is not one we read.
        let h = header.replace("\"F32\"", &format!("\"{dt}\""));
        let b = file(&h, &data);
        both_reject(&format!("weights as {dt}"), &b, bound(b.len()));
    }
    // A well-formed file whose tensors are I32 of the right element count.
    let w = small_weights();
    let e = w.embed_dim;
    let h = format!(r#"{{"q_proj.weight":{{"dtype":"I32","shape":[{e},{e}],"data_offsets":[0,{}]}}}}"#, 4 * e * e);
    let b = file(&h, &vec![0u8; 4 * e * e]);
    both_reject("I32 q_proj.weight", &b, bound(b.len()));
}

#[test]
fn weights_with_wrong_names_or_shapes_leave_the_module_unchanged() {
    let _g = counting_alloc::exclusive();
    let (header, data) = split(&weights_bytes());
    let edits = [
        ("\"q_proj.weight\"", "\"q_proj.weigh\""),   // missing parameter
        ("\"out_proj.bias\"", "\"out_proj.bias2\""), // unknown tensor + missing
        ("\"shape\":[8,8]", "\"shape\":[4,16]"),     // transposed-ish shape, same bytes
        ("\"shape\":[8]", "\"shape\":[2,4]"),        // wrong rank, same bytes
    ];
    for (from, to) in edits {
        assert!(header.contains(from), "fixture lacks {from}");
        let h = header.replacen(from, to, 1);
        let b = file(&h, &data);
        let pristine = small_weights();
        let mut w = pristine.clone();
        let err = load_bytes(&mut w, &b);
        assert!(err.is_err(), "{from} -> {to} accepted");
        assert!(w == pristine, "{from} -> {to}: module changed");
    }
    // The unedited file loads into a differently-initialised module and reproduces it.
    let mut other: MultiheadWeights<f32> = small_weights().zeros_like();
    load_bytes(&mut other, &file(&header, &data)).expect("clean file loads");
    assert!(other == small_weights());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(1000), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _g = counting_alloc::exclusive();
        golden_reader(&bytes);
        weights_reader(&bytes);
    }

    #[test]
    fn mutated_real_files_never_panic(
        which in 0..2usize,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let _g = counting_alloc::exclusive();
        let mut b = if which == 0 { golden_bytes() } else { weights_bytes() };
        for (pos, val) in edits {
            let i = pos.index(b.len());
            b[i] = val;
        }
        if truncate {
            let n = cut.index(b.len());
            b.truncate(n);
        }
        golden_reader(&b);
        weights_reader(&b);
    }
}
