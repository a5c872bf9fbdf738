//! Fuzz target: `attn_reliability::ring_fuzz::ring_plan` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = attn_reliability::ring_fuzz::ring_plan(data);
});
