//! The chunk ring: each rank's k/v rows travel around the ring and every block (a rank's
//! queries against the keys of one slice of another rank's rows) is computed where its
//! queries live. One protocol, generic over where blocks are computed ([`ChunkCompute`]:
//! the CPU kernels ([`CpuChunks`]) or, with feature `cuda`, the CUDA kernels on device
//! buffers) and how rows move ([`ChunkTransport`]: [`HostTransport`] stages them as bytes
//! over any [`Communicator`]; [`InProcessTransport`] hands the buffers themselves to the
//! next rank's thread, device buffers staying on the device; with features `nccl` and
//! `cuda`, `NcclDeviceTransport` sends device buffers by NCCL without host staging).
//! The handshake, the completion rounds, timeouts and typed errors are the plan ring's,
//! on the transport's control communicator.
//!
//! A rank's rows are pieces, one per contiguous range of global positions its layout gives
//! it ([`rank_pieces`]: one under the contiguous layout, up to two under zigzag). Masks are
//! functions of global positions, so a block is the kernels' block call on two ranges.
//! The k/v rows travel in [`ChunkOptions::rounds`] rounds, each carrying one slice of
//! every piece, so a rank holds one slice of other ranks' rows at a time instead of a
//! whole chunk. A slice goes only to the ranks whose queries reach it: under the ring
//! strategy from neighbour to neighbour, to the next rank, the previous one or both ways
//! (none when segments sit inside ranks, one step for a causal window under the contiguous
//! layout, one each way for a two-sided window); under all-gather straight to each rank;
//! the backward's dk/dv then go straight home. An explicit `Strategy::Ulysses` or
//! `Strategy::Hybrid` exchanges heads instead (`heads`): an all-to-all over the
//! transport, blocks over a [`HeadSlot`], and a second all-to-all back.
//!
//! [`Communicator`]: crate::Communicator

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod device_meter;
mod heads;
mod in_process;
#[cfg(all(feature = "nccl", feature = "cuda"))]
mod nccl_device;
mod protocol;
mod reach;
mod transport;

use std::ops::Range;

use attn_core::{AttnError, Element, Feature, Result, Shape4, TensorName};

use crate::plan::RingProblem;

pub use cpu::{CpuChunks, HostAcc, HostPartial, HostRowStats, HostRows};
#[cfg(feature = "cuda")]
pub use cuda::{CudaChunks, DeviceMasks, DeviceRowStats};
pub use device_meter::{DeviceMeter, Metered};
pub use in_process::InProcessTransport;
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub use nccl_device::{DeviceBuffers, NcclDeviceLink, NcclDeviceTransport};
pub use protocol::{ChunkForward, ChunkGradients, chunk_backward, chunk_forward};
pub use transport::{Arrived, ChunkTransport, Exchange, HostTransport, Parcel, ParcelShapes, Travel, TravelKind};

/// The global position ranges of `rank`'s pieces (empty ranges omitted).
pub fn rank_pieces(problem: &RingProblem, rank: usize) -> Vec<Range<usize>> {
    problem.layout.ranges(problem.seq, problem.world, rank)
}

/// Copy a piece (`[batch, rows, width]` values, as [`rank_pieces`] cuts a rank's rows) to
/// rows `range` of a global `[batch, seq, width]` buffer: the inverse of taking the piece.
/// Sizes that disagree are [`AttnError::InvalidArgument`].
pub fn place_piece<V: Copy>(
    global: &mut [V],
    seq: usize,
    range: &Range<usize>,
    width: usize,
    piece: &[V],
) -> Result<()> {
    let n = range.len() * width;
    let batch = piece.len().checked_div(n).unwrap_or(0);
    if piece.len() != batch * n || range.end > seq || global.len() < batch * seq * width {
        return Err(AttnError::InvalidArgument(format!(
            "a piece of {} values for rows {range:?} of width {width} does not fit a buffer of {} values, {seq} rows",
            piece.len(),
            global.len()
        )));
    }
    for (b, src) in piece.chunks_exact(n.max(1)).enumerate() {
        let at = (b * seq + range.start) * width;
        global[at..at + src.len()].copy_from_slice(src);
    }
    Ok(())
}

/// How the k/v rows travel: in `rounds` rounds (at least 1), round `s` carrying rows
/// `len·s/rounds .. len·(s+1)/rounds` of every piece. More rounds hold less of other
/// ranks' rows at once (one slice of `1/rounds` of a chunk) for more, smaller messages and
/// blocks. Where nothing travels (one rank, or every segment and band inside a rank's
/// pieces) a rank attends its own pieces whole, in one round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkOptions {
    rounds: usize,
}

impl Default for ChunkOptions {
    /// One round: each rank's whole chunk travels at once.
    fn default() -> Self {
        ChunkOptions { rounds: 1 }
    }
}

impl ChunkOptions {
    /// `rounds` rounds; 0 is [`AttnError::InvalidArgument`].
    pub fn with_rounds(rounds: usize) -> Result<Self> {
        if rounds == 0 {
            return Err(AttnError::InvalidArgument("a chunk ring needs at least 1 round".into()));
        }
        Ok(ChunkOptions { rounds })
    }

    /// The number of rounds.
    pub fn rounds(&self) -> usize {
        self.rounds
    }
}

/// The rows of one of a rank's pieces that travel in one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RoundSlice {
    /// Index of the piece among the rank's pieces.
    pub piece: usize,
    /// Rows within the piece.
    pub rows: Range<usize>,
    /// Global position of the slice's first row.
    pub start: usize,
    /// Whether the slice is the whole piece.
    pub whole: bool,
}

/// The slices of `rank`'s pieces in round `round` of `rounds` (empty slices omitted).
pub(crate) fn round_slices(problem: &RingProblem, rank: usize, round: usize, rounds: usize) -> Vec<RoundSlice> {
    rank_pieces(problem, rank)
        .into_iter()
        .enumerate()
        .filter_map(|(piece, r)| {
            let n = r.len();
            let rows = n * round / rounds..n * (round + 1) / rounds;
            (!rows.is_empty()).then(|| RoundSlice { piece, start: r.start + rows.start, whole: rows.len() == n, rows })
        })
        .collect()
}

/// The shapes of `rank`'s pieces with `heads` heads.
pub(crate) fn piece_shapes(problem: &RingProblem, rank: usize, heads: usize) -> Result<Vec<Shape4>> {
    rank_pieces(problem, rank)
        .into_iter()
        .map(|r| Shape4::new(problem.batch, r.len(), heads, problem.head_dim))
        .collect()
}

/// Which heads a block's rows hold: [`HeadSlot::Every`] head of the problem (rows of all
/// heads, outside the head strategies), or under Ulysses a rank's [`HeadSlot::Slot`]: query
/// heads `first..first + q heads` and the key/value heads from `kv_first` that they read,
/// attended with the patterns, masks and key/value heads of those global heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadSlot {
    #[default]
    Every,
    Slot {
        first: usize,
        kv_first: usize,
    },
}

impl HeadSlot {
    /// The first query head (0 for every head).
    pub fn first(&self) -> usize {
        match *self {
            HeadSlot::Every => 0,
            HeadSlot::Slot { first, .. } => first,
        }
    }
}

/// The refusal of a compute that attends whole heads only, for the head strategies.
pub(crate) fn whole_heads_only(backend: &'static str) -> AttnError {
    AttnError::Unsupported {
        backend,
        feature: Feature::Other(
            "Ulysses or hybrid on the chunk ring with this compute (its blocks attend every head): use the CPU or CUDA \
             chunk compute, or the ring or all-gather strategy",
        ),
    }
}

/// One block: the query rows of one piece (global positions `q_start..`) against the
/// key/value rows of one piece (`k_start..`), of the heads of `heads`, under every pattern
/// of the problem's config, its band and its masks (`masks`: as [`ChunkCompute::masks`]
/// prepared them).
#[derive(Debug)]
pub struct ChunkBlock<'a, R, M> {
    pub problem: &'a RingProblem,
    pub masks: &'a M,
    pub q: &'a R,
    pub q_start: usize,
    pub k: &'a R,
    pub v: &'a R,
    pub k_start: usize,
    pub heads: HeadSlot,
}

/// What the backward of a block reads for its query rows: `grad_out` (q's shape), the
/// FINAL lse and `delta = grad_out . out` of the forward.
#[derive(Debug)]
pub struct ChunkUpstream<'a, R, S> {
    pub grad_out: &'a R,
    pub lse: &'a S,
    pub delta: &'a S,
}

/// The f32 accumulators a block's backward adds to: dq of its query piece, dk and dv of
/// its key piece.
#[derive(Debug)]
pub struct ChunkGrads<'a, A> {
    pub dq: &'a mut A,
    pub dk: &'a mut A,
    pub dv: &'a mut A,
}

/// Check that per-row values `name` (their shape `got`, `None` where their values do not
/// fill `declared`) fit rows of `rows`.
pub(crate) fn check_stats(name: TensorName, got: Option<Shape4>, declared: Shape4, rows: Shape4) -> Result<()> {
    let want = Shape4 { head_dim: 1, ..rows };
    match got {
        Some(g) if g == want => Ok(()),
        Some(g) => {
            Err(AttnError::ShapeMismatch { tensor: name, expected: want.dims().to_vec(), got: g.dims().to_vec() })
        }
        None => {
            Err(AttnError::InvalidArgument(format!("{name}: its values do not fill its shape {:?}", declared.dims())))
        }
    }
}

/// Check that `len` per-row values fill a piece of `shape` (`[batch, rows, heads]`).
pub(crate) fn check_bsh_len(shape: Shape4, len: usize) -> Result<()> {
    if len == shape.lse_len() {
        return Ok(());
    }
    let Shape4 { batch, seq, heads, .. } = shape;
    Err(AttnError::InvalidArgument(format!(
        "{len} per-row values for a piece of batch {batch}, rows {seq}, heads {heads}"
    )))
}

/// Where the blocks of a chunk ring are computed: tensors live in this compute's memory,
/// every block is a call on them, and accumulators never leave it except through a
/// transport.
pub trait ChunkCompute<T: Element> {
    /// Rows `[batch, rows, heads, head_dim]` of `T`, contiguous.
    type Rows;
    /// The forward's f32 accumulators of one query piece: output (normalised) and lse.
    type Partial;
    /// f32 gradient accumulators `[batch, rows, heads, head_dim]`.
    type Acc;
    /// f32 per-row values `[batch, rows, heads]` (lse, delta).
    type RowStats;
    /// The problem's masks in this compute's memory (prepared once per call).
    type Masks;

    /// The shape of `rows`.
    fn shape_of(&self, rows: &Self::Rows) -> Shape4;
    /// Prepare the problem's masks, and whatever the blocks need ready before the first
    /// round is posted (a device's kernels, loaded).
    fn masks(&self, problem: &RingProblem) -> Result<Self::Masks>;
    /// An empty forward partial for a query piece (`out = 0`, `lse = -inf`).
    fn empty_partial(&self, q: Shape4) -> Result<Self::Partial>;
    /// Zeroed gradient accumulators.
    fn zero_acc(&self, shape: Shape4) -> Result<Self::Acc>;
    /// LSE-merge the block into `partial` (the query piece's).
    fn forward_block(&self, block: &ChunkBlock<'_, Self::Rows, Self::Masks>, partial: &mut Self::Partial)
    -> Result<()>;
    /// The output (each head's `out_scale` applied, in `T`) and lse of a finished partial.
    fn finish_forward(&self, problem: &RingProblem, partial: &Self::Partial) -> Result<(Self::Rows, Self::RowStats)>;
    /// `delta = dot(grad_out, out)` per row, less the LSE's gradient where one is given
    /// (`lse_grad` is `(grad_lse, lse)`) and the row's lse is finite: `d lse / d s = p`.
    fn delta(
        &self,
        grad_out: &Self::Rows,
        out: &Self::Rows,
        lse_grad: Option<(&Self::RowStats, &Self::RowStats)>,
    ) -> Result<Self::RowStats>;
    /// The `[batch, rows, heads]` shape of per-row values (head_dim 1), `None` where the
    /// values do not fill it.
    fn stats_shape(&self, stats: &Self::RowStats) -> Option<Shape4>;
    /// Per-row values of a piece of `shape` (head_dim ignored) from `values` laid out
    /// `[batch, rows, heads]`, such as a piece of the LSE's gradient.
    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<Self::RowStats>;
    /// Add the block's gradients to `grads`.
    fn backward_block(
        &self,
        block: &ChunkBlock<'_, Self::Rows, Self::Masks>,
        upstream: &ChunkUpstream<'_, Self::Rows, Self::RowStats>,
        grads: ChunkGrads<'_, Self::Acc>,
    ) -> Result<()>;
    /// An accumulator converted to `T`.
    fn store_acc(&self, acc: &Self::Acc) -> Result<Self::Rows>;
    /// Append `rows` as little-endian `T` values (for host-staged transports).
    fn rows_to_bytes(&self, rows: &Self::Rows, out: &mut Vec<u8>) -> Result<()>;
    /// Rows of `shape` from little-endian `T` values.
    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Self::Rows>;
    /// Append an accumulator as little-endian f32 values.
    fn acc_to_bytes(&self, acc: &Self::Acc, out: &mut Vec<u8>) -> Result<()>;
    /// An accumulator of `shape` from little-endian f32 values.
    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Self::Acc>;
    /// The bytes [`ChunkCompute::acc_to_bytes`] appends for `acc` (4 per f32 value), so a
    /// host-staged message is sized once, before it is filled.
    fn acc_bytes(&self, acc: &Self::Acc) -> usize;
    /// A copy of rows `rows` (within the sequence axis, every batch) of `src`.
    fn slice_rows(&self, src: &Self::Rows, rows: Range<usize>) -> Result<Self::Rows>;
    /// Zeroed rows of `shape`.
    fn zero_rows(&self, shape: Shape4) -> Result<Self::Rows>;
    /// Overwrite rows `at..at + src rows` of `dst` (every batch) with `src`.
    fn write_rows(&self, dst: &mut Self::Rows, at: usize, src: &Self::Rows) -> Result<()>;
    /// Wait until every copy and block queued so far has finished (a no-op where calls are
    /// synchronous).
    fn sync(&self) -> Result<()>;

    // The head strategies' copies (Ulysses and the hybrid move heads, not rows). A compute
    // without them refuses those strategies with a typed error.

    /// A copy of heads `heads` of `src` (every row).
    fn take_heads(&self, _src: &Self::Rows, _heads: Range<usize>) -> Result<Self::Rows> {
        Err(whole_heads_only("chunk ring"))
    }
    /// Overwrite heads `first..first + src heads` of `dst` (same rows) with `src`.
    fn put_heads(&self, _dst: &mut Self::Rows, _first: usize, _src: &Self::Rows) -> Result<()> {
        Err(whole_heads_only("chunk ring"))
    }
    /// A copy of heads `heads` of an accumulator (every row).
    fn take_acc_heads(&self, _src: &Self::Acc, _heads: Range<usize>) -> Result<Self::Acc> {
        Err(whole_heads_only("chunk ring"))
    }
    /// Add `src` to heads `first..first + src heads` of `dst` (same rows).
    fn add_acc_heads(&self, _dst: &mut Self::Acc, _first: usize, _src: &Self::Acc) -> Result<()> {
        Err(whole_heads_only("chunk ring"))
    }
    /// Per-row values as an accumulator of head_dim 1 (the form they travel in).
    fn stats_as_acc(&self, _stats: &Self::RowStats) -> Result<Self::Acc> {
        Err(whole_heads_only("chunk ring"))
    }
    /// An accumulator of head_dim 1 as per-row values.
    fn acc_as_stats(&self, _acc: &Self::Acc) -> Result<Self::RowStats> {
        Err(whole_heads_only("chunk ring"))
    }
    /// [`ChunkCompute::finish_forward`] of a partial over the heads of `slot`.
    fn finish_forward_slot(
        &self,
        _problem: &RingProblem,
        _partial: &Self::Partial,
        _slot: HeadSlot,
    ) -> Result<(Self::Rows, Self::RowStats)> {
        Err(whole_heads_only("chunk ring"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placed_piece_lands_at_its_rows_of_every_batch_and_a_misfit_is_an_error() {
        // [batch 2, seq 5, width 3] with values b*100 + pos*10 + col; the piece is rows 1..3.
        let global: Vec<u32> = (0..2 * 5 * 3).map(|i| (i / 15) * 100 + (i % 15 / 3) * 10 + i % 3).collect();
        let piece: Vec<u32> = [0u32, 1]
            .iter()
            .flat_map(|&b| (1..3).flat_map(move |p| (0..3).map(move |c| b * 100 + p * 10 + c)))
            .collect();
        let mut out = vec![0u32; global.len()];
        place_piece(&mut out, 5, &(1..3), 3, &piece).unwrap();
        for (i, (&o, &g)) in out.iter().zip(&global).enumerate() {
            let pos = i % 15 / 3;
            assert_eq!(o, if (1..3).contains(&pos) { g } else { 0 }, "value {i}");
        }
        assert!(place_piece(&mut out, 5, &(1..3), 3, &piece[1..]).is_err());
        assert!(place_piece(&mut out, 5, &(4..6), 3, &piece).is_err());
        assert!(place_piece(&mut out[..20], 5, &(1..3), 3, &piece).is_err());
    }
}
