//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod block_mask_layer;
mod cpu_backend;
mod cpu_cross;
mod errors;
mod gradcheck_encoder;
mod gradcheck_layer;
mod low_precision;
mod masked_truncation;
#[cfg(feature = "ring")]
mod ordered_ring;
mod proptest_backends;
mod qk_ln;
#[cfg(feature = "ring")]
mod ring_layer;
mod segment_window;
mod token_order;
mod token_order_cross;
mod weights_io;
mod window_layer;
mod workspace;
