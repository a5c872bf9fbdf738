//! Fuzz target: `attn_reliability::fuzz_targets::weights_reader` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    attn_reliability::fuzz_targets::weights_reader(data);
});
