//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod backend_properties;
mod backend_reference;
mod bf16_pairs;
mod block_api;
mod block_mask_reference;
mod caller_errors;
mod common;
mod cross_attention;
mod cuda_alignment;
mod cuda_block_masks;
mod cuda_bwd_q64;
mod cuda_determinism;
mod cuda_direct_grads;
mod cuda_emulation;
mod cuda_emulation_cases;
mod cuda_emulation_paths;
mod cuda_epilogues;
mod cuda_head_window;
mod cuda_hopper;
mod cuda_persistent;
mod cuda_scratch;
mod cuda_three_stages;
mod features_reference;
mod golden;
mod isa_choice;
mod lse_gradient_inputs;
