//! Attack tests for `attn` live in `tests/`; this library holds shared helpers for them.
#![forbid(unsafe_code)]
