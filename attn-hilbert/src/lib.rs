//! Spatially local token orders for dilated attention on 2D and 3D inputs.
//!
//! Dilated attention is local along the sequence; when tokens are image patches
//! or voxels, row-major order puts vertical neighbours a whole row apart, so
//! segments cut across space. Serialising the grid along a generalised Hilbert
//! curve keeps neighbours close in the sequence: each segment (and each ring
//! rank's contiguous chunk) becomes a compact spatial patch.
//!
//! - [`TokenOrder`]: row-major, Z-order or generalised Hilbert ("gilbert") order of a
//!   `height x width` grid or `depth x height x width` box of any size (not only
//!   powers of two), generated in `O(n)` and cached per `(kind, grid)` ([`OrderCache`]).
//! - [`Permutation`]: the order and its inverse, applied to `[batch, seq, heads,
//!   head_dim]` or `[batch, seq, embed]` buffers out of place (one row copy per
//!   token) or in place (cycle walking with a visited bitset).
//! - [`locality`]: neighbour-in-segment fraction and mean segment diameter.
//! - [`bench`]: plain-number timings for `cargo xtask bench --case hilbert`.
//!
//! # Using an order around attention
//!
//! Permute the row-major tokens into curve order, run attention on the permuted
//! sequence, and restore row-major order. Per-token maps (projections, norms)
//! commute with the permutation, so a layer can permute its `[batch, seq, embed]`
//! input once and restore its output once:
//!
//! ```
//! use attn_hilbert::{TokenLayout, TokenOrder};
//! # fn main() -> attn_core::Result<()> {
//! let order = TokenOrder::hilbert_2d(6, 10)?;          // cached after the first call
//! let perm = order.permutation();                       // &Arc<Permutation>
//! let layout = TokenLayout::bse(2, order.len(), 8)?;    // [batch, seq, embed]
//! let x: Vec<f32> = (0..layout.numel()?).map(|i| i as f32).collect();
//! let mut xp = vec![0.0f32; x.len()];
//! perm.apply(&layout, &x, &mut xp)?;                    // row-major -> Hilbert order
//! // ... attention on `xp` (a ring rank takes a contiguous chunk: a compact patch) ...
//! let mut back = vec![0.0f32; x.len()];
//! perm.unapply(&layout, &xp, &mut back)?;               // Hilbert -> row-major order
//! assert_eq!(back, x);
//! perm.apply_in_place(&layout, &mut back)?;             // same, without a second buffer
//! assert_eq!(back, xp);
//! # Ok(()) }
//! ```
//!
//! For `[batch, seq, heads, head_dim]` use `TokenLayout::bshd(shape)`; for the
//! LSE `[batch, seq, heads]` use `TokenLayout::bse(batch, seq, heads)`.
//! `perm.apply_tokens(src, dst, token_len)` infers the batch count.
//!
//! # Continuity
//!
//! The Hilbert order is the Gilbert++ curve (see [`gilbert`](crate)'s module
//! docs): consecutive positions are face neighbours in the grid, except for a few
//! diagonal steps where the parity of the sizes forbids a face-neighbour path
//! (in 2D: the longer side odd and the shorter even). The property tests check,
//! on many sizes including odd and prime sides, that every step is a face or
//! diagonal neighbour step and that 2D curves take at most one diagonal step
//! (none when a face-neighbour path exists), 3D at most the bound stated in
//! `tests/continuity.rs`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod cache;
mod gilbert;
pub mod grid;
pub mod locality;
pub mod order;
pub mod permutation;
mod zorder;

pub use cache::OrderCache;
pub use grid::Grid;
pub use locality::{Locality, locality, mean_segment_diameter, neighbour_in_segment_fraction};
pub use order::{OrderKind, TokenOrder, generate};
pub use permutation::{Permutation, TokenLayout};
