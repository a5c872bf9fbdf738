//! Fuzz target: `attn_reliability::fuzz_targets::config_shape` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = attn_reliability::fuzz_targets::config_shape(data);
});
