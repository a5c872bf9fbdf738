//! Seeded test tensors from the workspace's one generator, [`attn_core::SeededRng`].

pub use attn_core::SeededRng;

/// `n` standard normal values from `seed`.
pub fn random_vec(seed: u64, n: usize) -> Vec<f32> {
    SeededRng::new(seed).normal_vec(n)
}
