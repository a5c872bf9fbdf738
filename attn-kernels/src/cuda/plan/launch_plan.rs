//! A block's kernel launches as data ([`Planned`]: kernel, grid, shared memory, argument
//! offsets and parameters), planned once from the block's geometry, so the device
//! ([`crate::cuda::forward_block`], [`crate::cuda::backward_block`]) and the CPU emulation
//! of the kernels ([`crate::cuda::exec::emulation`]) execute the same plan.

use attn_core::{AttnError, Band, BlockDims, BlockMask, DType, DilatedConfig, Mixing, PackedSequences, Result, Shape4};

use super::fuse_table::{FusePart, fused_launch, grid, persistent_launch};
use super::head_window::HeadWindow;
use super::params::{AttnParams, BlockLayout, MAX_FUSED, attn_params};
use super::patterns::{
    BackwardDq, BackwardKernel, BackwardKeys, BackwardLoads, BackwardMma, BackwardOptions, BackwardQueries,
    ForwardKernel, ForwardMma, ForwardOptions, ForwardRows, ForwardStages, MmaDq, PatternFusion, PatternLaunch,
    SeqPiece, THREADS, backward_kernel, forward_kernel, head_sweeps, seq_pieces, window_launches,
};
use super::source::{
    MMA_HEAD_DIMS, WGMMA_HEAD_DIMS, mma_fused_kernel_name, mma_persistent_kernel_name, wgmma_bwd_kernel_name,
    wgmma_bwd_smem_bytes, wgmma_fwd_kernel_name, wgmma_fwd_smem_bytes,
};
use super::tensor_maps::BOX_ROWS;

/// Shapes, strides and positions of a block (what planning needs of its tensors).
#[derive(Debug, Clone, Copy)]
pub struct BlockGeometry<'a> {
    pub cfg: &'a DilatedConfig,
    pub q: (Shape4, [usize; 4]),
    pub q_start: usize,
    pub k: (Shape4, [usize; 4]),
    pub v_strides: [usize; 4],
    pub k_start: usize,
    /// grad_out's strides (the backward; q's shape), or the output's (a direct forward,
    /// [`plan_forward_direct`]).
    pub g_strides: Option<[usize; 4]>,
    pub band: Band,
    /// The key padding mask's row length (`[batch, seq]` flags), where there is one.
    pub kpad_seq: Option<usize>,
    pub packing: Option<PackedSequences<'a>>,
    /// The block mask's sizes, where there is one (its entries stay with the executor).
    pub block_mask: Option<BlockMaskShape>,
    /// The run of a problem's heads the tensors hold (a Ulysses slot); `None`: every head.
    pub window: Option<HeadWindow>,
}

/// What planning needs of a block mask: its sizes `[batch, heads, q_blocks, k_blocks]` and
/// positions a block. A block-masked block runs on the warp-per-row kernels, which read the
/// mask per (query, key block) and jump over a removed block whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMaskShape {
    pub dims: BlockDims,
    pub block_size: usize,
}

impl From<BlockMask<'_>> for BlockMaskShape {
    fn from(m: BlockMask<'_>) -> Self {
        BlockMaskShape { dims: m.dims(), block_size: m.block_size() }
    }
}

impl BlockMaskShape {
    /// The kernels' strides of the mask: batch, head (0 where one entry serves all) and row.
    fn strides(&self) -> [i64; 3] {
        let d = self.dims;
        let per_head = d.q_blocks * d.k_blocks;
        let sb = if d.batch == 1 { 0 } else { d.heads * per_head };
        let sh = if d.heads == 1 { 0 } else { per_head };
        [sb as i64, sh as i64, d.k_blocks as i64]
    }
}

/// The argument list a kernel takes (the signatures in `kernels/*.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signature {
    /// `(q, k, v, o_acc, lse_acc, AttnParams)`: LSE-merge into the f32 partial.
    Forward,
    /// `(q, k, v, out, lse, AttnParams)` with `out_direct`: write the output (in the input
    /// dtype, at `ArgOffsets::g` in the `g_strides`) and the lse of the rows computed.
    ForwardDirect,
    /// `(q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, AttnParams)`; with `out_direct`,
    /// dk and dv in the input dtype in place of their accumulators ([`DirectGrads`]).
    BackwardAll,
    /// `(q, k, v, go, lse, delta, dk_acc, dv_acc, AttnParams)`; `out_direct` as above.
    BackwardDkv,
    /// `(q, k, v, go, lse, delta, dq_acc, AttnParams)`; with `out_direct`, dq in the input
    /// dtype in place of its accumulator.
    BackwardDq,
}

/// Element offsets of a launch's arguments into the block's buffers: q, k, v, grad_out (in
/// their strides), the f32 `[rows, heads, d]` accumulators of q rows (out or dq) and of k
/// rows (dk, dv), and the f32 `[rows, heads]` values of q rows (lse, delta).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArgOffsets {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub g: usize,
    pub q_acc: usize,
    pub k_acc: usize,
    pub q_rows: usize,
}

/// One kernel launch of a block.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub kernel: String,
    pub signature: Signature,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub smem_bytes: u32,
    pub offsets: ArgOffsets,
    /// `params.kpad` holds the element offset of the launch's first padding flag into the
    /// mask (the executor adds the mask's address) where `kpad` is set.
    pub params: AttnParams,
    pub kpad: bool,
    /// `params.bmask` holds the element offset of the tensors' first head's rows into the
    /// block mask (0 without a head window); the executor adds the mask's address.
    pub bmask: bool,
    /// A persistent launch: `params.work` is 0 and the executor sets it to its stream's
    /// work counter (zeroed once, when allocated; the kernel leaves it zeroed), and cuts
    /// grid x (one block an item here) to the blocks the machine holds at once.
    pub work: bool,
    /// An sm_90a forward or backward (TMA, wgmma): the executor encodes its tensor maps
    /// ([`super::tensor_maps::launch_maps`]) and passes them after the parameters, and
    /// runs this `mma.sync` launch of the same rows instead where they cannot be encoded.
    pub fallback: Option<Box<Planned>>,
}

impl Planned {
    /// The launch's parameters for tensors whose element 0 is at `starts` (q, k, v, and
    /// grad_out or the direct output where the launch has one; `size` bytes an element):
    /// a tensor whose first row as launched (at its [`ArgOffsets`]) is off a 16-byte
    /// boundary loses its 16-byte loads, since a view of a framework's tensor may start
    /// anywhere and a misaligned vector access faults on the GPU.
    pub fn params_at(&self, starts: [Option<u64>; 4], size: usize) -> AttnParams {
        let o = self.offsets;
        let mut params = self.params;
        for (bit, (start, off)) in starts.into_iter().zip([o.q, o.k, o.v, o.g]).enumerate() {
            if start.is_some_and(|a| !(a + (off * size) as u64).is_multiple_of(16)) {
                params.vec &= !(1 << bit);
            }
        }
        params
    }
}

/// The parameters of one (sequence piece, pattern) launch: the blocks' strides, the
/// piece's rows with positions relative to its sequence, the band, and the offset of the
/// padding flag of the piece's first key.
fn piece_params(g: &BlockGeometry<'_>, piece: &SeqPiece, launch: &PatternLaunch) -> Result<AttnParams> {
    let layout = BlockLayout {
        q: (g.q.0.with_seq(piece.q.len())?, g.q.1),
        k: (g.k.0.with_seq(piece.k.len())?, g.k.1),
        v_strides: g.v_strides,
        g_strides: g.g_strides,
        q_start: g.q_start + piece.q.start - piece.seq_start,
        k_start: g.k_start + piece.k.start - piece.seq_start,
        band: g.band,
    };
    let mut p = attn_params(g.cfg, &layout, launch);
    if let Some(seq) = g.kpad_seq {
        p.kpad = (g.k_start + piece.k.start) as u64;
        p.kpad_sb = seq as i64;
    }
    if let Some(m) = g.block_mask {
        [p.bm_sb, p.bm_sh, p.bm_nbk] = m.strides();
        p.bm_size = m.block_size as i64;
    }
    if let Some(w) = &g.window {
        p.kv_group = w.group() as i64;
        p.kv_base = w.kv_first as i64;
        // The mask's rows are the problem's heads: the tensors' head 0 is row `first`.
        p.bmask = (w.first as i64 * p.bm_sh) as u64;
    }
    Ok(p)
}

/// The block's per-sequence pieces (one piece without packing).
fn pieces(g: &BlockGeometry<'_>) -> Vec<SeqPiece> {
    let (q, k) = (g.q_start..g.q_start + g.q.0.seq, g.k_start..g.k_start + g.k.0.seq);
    seq_pieces(g.packing.map(|p| p.cu_seqlens()), q, k)
}

/// The offsets of a piece's arguments.
fn offsets(g: &BlockGeometry<'_>, piece: &SeqPiece) -> ArgOffsets {
    // Packing has batch 1, so a piece is a row offset into every tensor.
    let (qo, ko) = (piece.q.start, piece.k.start);
    let (heads, kv_heads, d) = (g.q.0.heads, g.k.0.heads, g.q.0.head_dim);
    ArgOffsets {
        q: qo * g.q.1[1],
        k: ko * g.k.1[1],
        v: ko * g.v_strides[1],
        g: g.g_strides.map_or(0, |s| qo * s[1]),
        q_acc: qo * heads * d,
        k_acc: ko * kv_heads * d,
        q_rows: qo * heads,
    }
}

/// The forward launches of a block of dtype `dtype` (kernel suffix `suffix`), the
/// tensor-core kernel taking `opts.rows` query rows a block and, with 64 rows where every
/// head has one pattern, fusing the patterns' launches as `opts.fusion` says.
pub fn plan_forward(g: &BlockGeometry<'_>, dtype: DType, suffix: &str, opts: ForwardOptions) -> Result<Vec<Planned>> {
    let kernel = block_forward_kernel(g, dtype, suffix, opts);
    let hopper = hopper_forward(g, dtype, suffix, opts);
    // The fused and persistent kernels: 64 rows a block, where every head has one pattern
    // and no block mask (the table orders its patterns by keys a row, which a mask changes);
    // the sm_90a forward runs one launch a pattern.
    let table_kernel = match &kernel {
        ForwardKernel::Mma { padded_d, rows: ForwardRows::M64, stages, .. }
            if one_pattern_per_head(g.cfg) && g.block_mask.is_none() && hopper.is_none() =>
        {
            match opts.fusion {
                PatternFusion::PerPattern => None,
                PatternFusion::Fused => Some((opts.fusion, mma_fused_kernel_name(suffix, *padded_d, *stages))),
                PatternFusion::Persistent => {
                    Some((opts.fusion, mma_persistent_kernel_name(suffix, *padded_d, *stages)))
                }
            }
        }
        _ => None,
    };
    let (kernel, per_block, threads, smem) = match kernel {
        ForwardKernel::Mma { name, rows, smem_bytes, .. } => (name, rows.rows(), rows.threads(), smem_bytes),
        ForwardKernel::Rows { name } => (name, (THREADS / 32) as usize, THREADS, 0),
    };
    let smem_bytes = u32::try_from(smem).map_err(|_| AttnError::InvalidArgument("shared memory size".into()))?;
    let mut out = Vec::new();
    let launches = window_launches(g.cfg, g.q.0.heads, g.window.as_ref());
    for piece in pieces(g) {
        let (mut parts, mut hopper_blocks) = (Vec::new(), Vec::new());
        for pl in &launches {
            let params = piece_params(g, &piece, pl)?;
            let rows = pl.max_selected(params.q_start as usize, piece.q.len());
            let blocks = rows.div_ceil(per_block);
            if blocks > 0 {
                parts.push(FusePart { params, blocks, heads: pl.heads.len() });
                hopper_blocks.push(rows.div_ceil(BOX_ROWS as usize));
            }
        }
        let groups = if table_kernel.is_some() {
            // Heaviest blocks first: a launch's last wave is then its lightest blocks.
            parts.sort_by_key(|p| std::cmp::Reverse(p.keys_a_row()));
            parts.chunks(MAX_FUSED).map(<[FusePart]>::to_vec).collect()
        } else {
            parts.into_iter().map(|p| vec![p]).collect::<Vec<_>>()
        };
        for (i, group) in groups.into_iter().enumerate() {
            let (name, (params, grid)) = match &table_kernel {
                Some((PatternFusion::Persistent, name)) => (name.clone(), persistent_launch(&group, g.q.0.batch)?),
                Some((_, fused)) if group.len() > 1 => (fused.clone(), fused_launch(&group, g.q.0.batch)?),
                _ => (kernel.clone(), fused_launch(&group, g.q.0.batch)?),
            };
            let planned = Planned {
                kernel: name,
                signature: Signature::Forward,
                grid,
                threads,
                smem_bytes,
                offsets: offsets(g, &piece),
                params,
                kpad: g.kpad_seq.is_some(),
                bmask: g.block_mask.is_some(),
                work: params.work_items > 0,
                fallback: None,
            };
            out.push(match &hopper {
                // One pattern a group here: its blocks of 64 selected rows.
                Some((name, smem)) => {
                    let blocks = u32::try_from(hopper_blocks[i])
                        .map_err(|_| AttnError::InvalidArgument("more row blocks than a grid holds".into()))?;
                    Planned {
                        kernel: name.clone(),
                        grid: (blocks, grid.1, grid.2),
                        threads: HOPPER_THREADS,
                        smem_bytes: *smem,
                        fallback: Some(Box::new(planned.clone())),
                        ..planned
                    }
                }
                None => planned,
            });
        }
    }
    Ok(out)
}

/// Threads a block of the sm_90a forward and backward: a producer and a consumer warpgroup.
const HOPPER_THREADS: u32 = 256;

/// The sm_90a forward's name and dynamic shared memory where `opts` asks for it and the
/// block can take it (f16/bf16, a head dim it has an instance for, no block mask, no head
/// window: a Ulysses slot runs the mma.sync forward); the executor still falls back launch
/// by launch ([`Planned::fallback`]).
pub fn hopper_forward(
    g: &BlockGeometry<'_>,
    dtype: DType,
    suffix: &str,
    opts: ForwardOptions,
) -> Option<(String, u32)> {
    let padded = MMA_HEAD_DIMS.iter().copied().find(|&p| p >= g.q.0.head_dim)?;
    let takes = opts.mma == ForwardMma::Wgmma
        && matches!(dtype, DType::F16 | DType::BF16)
        && WGMMA_HEAD_DIMS.contains(&padded)
        && g.block_mask.is_none()
        && g.window.is_none();
    let smem = u32::try_from(wgmma_fwd_smem_bytes(padded)).ok()?;
    takes.then(|| (wgmma_fwd_kernel_name(suffix, padded), smem))
}

/// The sm_90a backward's name and dynamic shared memory where `opts` asks for it and the
/// block can take it (f16/bf16, a head dim it has an instance for, no block mask, no head
/// window, dQ summed by the key-major kernel); the executor still falls back launch by launch
/// ([`Planned::fallback`]) to the `mma.sync` launch of the same keys.
pub fn hopper_backward(
    g: &BlockGeometry<'_>,
    dtype: DType,
    suffix: &str,
    opts: BackwardOptions,
) -> Option<(String, u32)> {
    let padded = MMA_HEAD_DIMS.iter().copied().find(|&p| p >= g.q.0.head_dim)?;
    let takes = opts.mma == BackwardMma::Wgmma
        && opts.dq == BackwardDq::Atomic
        && matches!(dtype, DType::F16 | DType::BF16)
        && WGMMA_HEAD_DIMS.contains(&padded)
        && g.block_mask.is_none()
        && g.window.is_none();
    let smem = u32::try_from(wgmma_bwd_smem_bytes(padded)).ok()?;
    takes.then(|| (wgmma_bwd_kernel_name(suffix, padded), smem))
}

/// The forward kernel of a block: [`forward_kernel`]'s choice, or under a block mask the
/// 64-row two-stage tensor-core kernel that reads it (`_bm_`; f16/bf16) or the row kernel
/// (f32), which reads it too.
pub fn block_forward_kernel(g: &BlockGeometry<'_>, dtype: DType, suffix: &str, opts: ForwardOptions) -> ForwardKernel {
    if g.block_mask.is_none() {
        return forward_kernel(dtype, suffix, g.q.0.head_dim, opts);
    }
    let opts = ForwardOptions { rows: ForwardRows::M64, stages: ForwardStages::Two, ..opts };
    match forward_kernel(dtype, suffix, g.q.0.head_dim, opts) {
        ForwardKernel::Mma { name, padded_d, rows, stages, block_n, smem_bytes } => {
            ForwardKernel::Mma { name: masked_name(&name, suffix), padded_d, rows, stages, block_n, smem_bytes }
        }
        rows => rows,
    }
}

/// The backward kernels of a block: [`backward_kernel`]'s choice, or under a block mask
/// the tensor-core kernels that read it (`_bm_`: 64 keys a block, 32-query tiles loaded
/// before their compute, either dq sum; f16/bf16) or the row kernels (f32), which read it too.
pub fn block_backward_kernel(
    g: &BlockGeometry<'_>,
    dtype: DType,
    suffix: &str,
    opts: BackwardOptions,
) -> BackwardKernel {
    if g.block_mask.is_none() {
        return backward_kernel(dtype, suffix, g.q.0.head_dim, opts);
    }
    let opts =
        BackwardOptions { keys: BackwardKeys::K64, queries: BackwardQueries::Q32, loads: BackwardLoads::Sync, ..opts };
    match backward_kernel(dtype, suffix, g.q.0.head_dim, opts) {
        BackwardKernel::Mma { name, keys, smem_bytes, dq } => BackwardKernel::Mma {
            name: masked_name(&name, suffix),
            keys,
            smem_bytes,
            dq: dq.map(|d| MmaDq { name: masked_name(&d.name, suffix), ..d }),
        },
        rows => rows,
    }
}

/// The block-mask-reading instance of tensor-core kernel `name` (dtype `suffix`): `_bm`
/// before the dtype.
fn masked_name(name: &str, suffix: &str) -> String {
    name.replacen(&format!("_{suffix}_d"), &format!("_bm_{suffix}_d"), 1)
}

/// Whether every head of `cfg` has exactly one pattern (head groups, a window, or a
/// single pattern), so one launch covers each (row, head) of a whole call.
pub fn one_pattern_per_head(cfg: &DilatedConfig) -> bool {
    cfg.mixing() != Mixing::LongNet || cfg.num_patterns() == 1
}

/// Whether a whole call's forward writes its output straight from the kernel: every head
/// has one pattern and the tensor-core kernel runs.
pub fn writes_direct(cfg: &DilatedConfig, kernel: &ForwardKernel) -> bool {
    matches!(kernel, ForwardKernel::Mma { .. }) && one_pattern_per_head(cfg)
}

/// The forward launches of a whole call written straight into the output (strides
/// `g.g_strides`, offsets `ArgOffsets::g`) and the lse, with no f32 partial and no
/// epilogue: planned where every head has one pattern and the tensor-core kernel runs;
/// `None` otherwise (then [`plan_forward`] and a partial). The caller zeroes the output and
/// fills the lse with `-inf` first (rows no pattern selects keep those).
pub fn plan_forward_direct(
    g: &BlockGeometry<'_>,
    dtype: DType,
    suffix: &str,
    opts: ForwardOptions,
) -> Result<Option<Vec<Planned>>> {
    if g.g_strides.is_none() || g.window.is_some() {
        return Ok(None);
    }
    if !writes_direct(g.cfg, &block_forward_kernel(g, dtype, suffix, opts)) {
        return Ok(None);
    }
    // `attn_params` already carries the heads' output scale.
    let mut plan = plan_forward(g, dtype, suffix, opts)?;
    fn direct(p: &mut Planned) {
        p.signature = Signature::ForwardDirect;
        p.params.out_direct = 1;
        if let Some(f) = p.fallback.as_deref_mut() {
            direct(f);
        }
    }
    plan.iter_mut().for_each(direct);
    Ok(Some(plan))
}

/// The backward launches of a block (`g.g_strides` set), the tensor-core kernel loading
/// its query tiles and taking its keys as `opts` says.
pub fn plan_backward(g: &BlockGeometry<'_>, dtype: DType, suffix: &str, opts: BackwardOptions) -> Result<Vec<Planned>> {
    let kernel = block_backward_kernel(g, dtype, suffix, opts);
    let hopper = hopper_backward(g, dtype, suffix, opts);
    let warps = (THREADS / 32) as usize;
    let group = g.q.0.heads / g.k.0.heads.max(1);
    let batch = g.q.0.batch;
    let mut out = Vec::new();
    let launches = window_launches(g.cfg, g.q.0.heads, g.window.as_ref());
    for piece in pieces(g) {
        let offsets = offsets(g, &piece);
        let planned = |kernel: &str, signature, threads, grid, smem_bytes, params| Planned {
            kernel: kernel.to_string(),
            signature,
            grid,
            threads,
            smem_bytes,
            offsets,
            params,
            kpad: g.kpad_seq.is_some(),
            bmask: g.block_mask.is_some(),
            work: false,
            fallback: None,
        };
        for pl in &launches {
            let base = piece_params(g, &piece, pl)?;
            let q_rows = pl.max_selected(base.q_start as usize, piece.q.len());
            let k_rows = pl.max_selected(base.k_start as usize, piece.k.len());
            // dk/dv writes: one sweep per residue of the group (see `head_sweeps`).
            for sw in head_sweeps(pl.heads.clone(), group) {
                let params = AttnParams { head0: sw.head0 as i64, head_step: sw.step as i64, ..base };
                match &kernel {
                    BackwardKernel::Mma { name, keys, smem_bytes, dq } => {
                        let smem = u32::try_from(*smem_bytes)
                            .map_err(|_| AttnError::InvalidArgument("shared memory size".into()))?;
                        let signature = if dq.is_some() { Signature::BackwardDkv } else { Signature::BackwardAll };
                        if let Some(grid) = grid(k_rows, keys.keys(), sw.count, batch)? {
                            let mma = planned(name, signature, keys.threads(), grid, smem, params);
                            out.push(match &hopper {
                                // Its blocks of 64 selected keys, the mma.sync launch behind it.
                                Some((name, smem)) if signature == Signature::BackwardAll => Planned {
                                    kernel: name.clone(),
                                    grid: (
                                        u32::try_from(k_rows.div_ceil(BOX_ROWS as usize)).map_err(|_| {
                                            AttnError::InvalidArgument("more key blocks than a grid holds".into())
                                        })?,
                                        grid.1,
                                        grid.2,
                                    ),
                                    threads: HOPPER_THREADS,
                                    smem_bytes: *smem,
                                    fallback: Some(Box::new(mma.clone())),
                                    ..mma
                                },
                                _ => mma,
                            });
                        }
                    }
                    BackwardKernel::Rows { dkv, .. } => {
                        if let Some(grid) = grid(k_rows, warps, sw.count, batch)? {
                            out.push(planned(dkv, Signature::BackwardDkv, THREADS, grid, 0, params));
                        }
                    }
                }
            }
            // dq rows are per query head: one launch of the dq kernel over the whole head range,
            // each row one block's (the row kernel: a warp a row; the tensor-core one: 64 rows).
            let heads = pl.heads.len();
            match &kernel {
                BackwardKernel::Rows { dq, .. } => {
                    if let Some(grid) = grid(q_rows, warps, heads, batch)? {
                        out.push(planned(dq, Signature::BackwardDq, THREADS, grid, 0, base));
                    }
                }
                BackwardKernel::Mma { dq: Some(dq), .. } => {
                    let smem = u32::try_from(dq.smem_bytes)
                        .map_err(|_| AttnError::InvalidArgument("shared memory size".into()))?;
                    if let Some(grid) = grid(q_rows, MmaDq::ROWS, heads, batch)? {
                        out.push(planned(&dq.name, Signature::BackwardDq, MmaDq::THREADS, grid, smem, base));
                    }
                }
                BackwardKernel::Mma { dq: None, .. } => {}
            }
        }
    }
    Ok(out)
}

/// The gradients a whole call's backward writes straight from the tensor-core kernels into
/// the caller's tensors (in the input dtype), with no f32 accumulator and no epilogue for
/// them; the others go through accumulators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectGrads {
    /// dk and dv (at k's and v's strides and offsets `ArgOffsets::k`, `ArgOffsets::v`).
    KeysValues,
    /// dq (at q's strides and offset `ArgOffsets::q`), by the deterministic dq kernel.
    Queries,
    /// dq, dk and dv.
    All,
}

impl DirectGrads {
    /// Whether dq is written directly.
    pub fn dq(self) -> bool {
        matches!(self, Self::Queries | Self::All)
    }

    /// Whether dk and dv are written directly.
    pub fn dkv(self) -> bool {
        matches!(self, Self::KeysValues | Self::All)
    }

    /// The direct gradients of two answers (dq; dk and dv together), `None` for neither.
    pub(crate) fn from_parts(dq: bool, dkv: bool) -> Option<Self> {
        match (dq, dkv) {
            (true, true) => Some(Self::All),
            (true, false) => Some(Self::Queries),
            (false, true) => Some(Self::KeysValues),
            (false, false) => None,
        }
    }
}

/// A whole call's backward launches with the gradients they write directly.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectBackward {
    pub launches: Vec<Planned>,
    pub grads: DirectGrads,
}

/// The backward launches of a whole call that write some gradients straight from the
/// tensor-core kernels, of those `allowed` (the ones the caller lays out like their
/// inputs, contiguous): dk and dv where every key row has one writer (every head one
/// pattern, as many key/value heads as query heads), dq where every query row has one
/// (every head one pattern, the deterministic dq kernel: [`BackwardDq`]);
/// `None` where none applies. The caller zeroes the direct gradients first (rows no
/// pattern selects, and padded keys, keep zeros).
pub fn plan_backward_direct(
    g: &BlockGeometry<'_>,
    dtype: DType,
    suffix: &str,
    opts: BackwardOptions,
    allowed: DirectGrads,
) -> Result<Option<DirectBackward>> {
    let BackwardKernel::Mma { dq, .. } = block_backward_kernel(g, dtype, suffix, opts) else {
        return Ok(None);
    };
    if !one_pattern_per_head(g.cfg) || g.window.is_some() {
        return Ok(None);
    }
    let dkv = allowed.dkv() && g.q.0.heads == g.k.0.heads;
    let Some(grads) = DirectGrads::from_parts(allowed.dq() && dq.is_some(), dkv) else {
        return Ok(None);
    };
    let mut launches = plan_backward(g, dtype, suffix, opts)?;
    for p in &mut launches {
        let direct = match p.signature {
            Signature::BackwardAll | Signature::BackwardDkv => grads.dkv(),
            Signature::BackwardDq => grads.dq(),
            Signature::Forward | Signature::ForwardDirect => false,
        };
        p.params.out_direct = i32::from(direct);
        if let Some(f) = p.fallback.as_deref_mut() {
            f.params.out_direct = i32::from(direct);
        }
    }
    Ok(Some(DirectBackward { launches, grads }))
}

#[cfg(test)]
mod tests;
