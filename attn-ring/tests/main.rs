//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod auto_strategy;
mod backend_masks;
mod block_masks;
mod bytes_formula;
mod caller_errors;
mod chunk_ring;
mod chunk_ring_bytes;
mod chunk_ring_heads;
mod chunk_ring_lse;
mod chunk_ring_memory;
mod common;
mod dtypes_and_views;
mod emulated_chunk_ring;
mod faults;
mod faults_pieces;
mod golden_ring;
mod long_segments;
mod nccl_emulated;
mod nccl_real_library;
mod nccl_stand_in;
mod proptest_ring;
mod proptest_ring_large;
mod rank_threads;
mod ulysses;
mod ulysses_faults;
