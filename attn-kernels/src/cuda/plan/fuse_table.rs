//! The pattern table of the tensor-core forward's fused and persistent launches: the
//! patterns of a call (disjoint head ranges) as one grid of (pattern, head, row block)
//! indices, heaviest patterns first, and the grids of every launch.

use attn_core::{AttnError, Result, SegmentPattern};

use super::params::{AttnParams, FusedPattern, MAX_FUSED};
use super::patterns::SelectedIndex;

/// The grid of `rows` rows, `per_block` a block, over `heads` and `batch`; `None` when empty.
pub(super) fn grid(rows: usize, per_block: usize, heads: usize, batch: usize) -> Result<Option<(u32, u32, u32)>> {
    let x = rows.div_ceil(per_block);
    if x == 0 {
        return Ok(None);
    }
    let too_big = || AttnError::InvalidArgument(format!("launch grid too large ({x} x {heads} x {batch})"));
    let gx = u32::try_from(x).ok().filter(|&g| g < i32::MAX as u32).ok_or_else(too_big)?;
    let gy = u32::try_from(heads).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    let gz = u32::try_from(batch).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    Ok(Some((gx, gy, gz)))
}

/// One pattern's launch of a piece: its parameters, row blocks a head, and heads.
#[derive(Debug, Clone, Copy)]
pub(super) struct FusePart {
    pub(super) params: AttnParams,
    pub(super) blocks: usize,
    pub(super) heads: usize,
}

impl FusePart {
    /// Keys a query row attends at most (selected indices): the segment's, cut by the band.
    pub(super) fn keys_a_row(&self) -> i64 {
        let p = &self.params;
        let pattern = SegmentPattern::new(p.w as usize, p.r as usize, p.fixed_off.max(0) as usize);
        let seg = SelectedIndex::new(&pattern).per_seg as i64;
        if p.band_left < 0 || p.band_right < 0 { seg } else { seg.min(p.band_left + p.band_right + 1) }
    }
}

/// The parameters and grid of one launch running `group`: a part alone is a plain launch
/// (grid y = heads); several are a fused one (`AttnParams::fused`, grid x enumerating each
/// part's (head, row block) pairs in turn).
pub(super) fn fused_launch(group: &[FusePart], batch: usize) -> Result<(AttnParams, (u32, u32, u32))> {
    let empty = || AttnError::InvalidArgument("a forward launch with no rows".into());
    let first = group.first().ok_or_else(empty)?;
    if group.len() == 1 {
        let grid = grid(first.blocks, 1, first.heads, batch)?.ok_or_else(empty)?;
        return Ok((first.params, grid));
    }
    let (params, blocks) = fuse_table(group)?;
    let grid = grid(blocks, 1, 1, batch)?.ok_or_else(empty)?;
    Ok((params, grid))
}

/// The parameters and nominal grid of a persistent launch running `group` (one part or
/// several): the fused table, its blocks times `batch` as work items
/// (`AttnParams::work_items`), one block an item until the executor cuts the grid to the
/// machine's.
pub(super) fn persistent_launch(group: &[FusePart], batch: usize) -> Result<(AttnParams, (u32, u32, u32))> {
    let (mut params, blocks) = fuse_table(group)?;
    // The counter runs past the items by one a block: keep it within u32 and the grid's x.
    let items = blocks
        .checked_mul(batch)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n < i32::MAX as u32 / 2)
        .ok_or_else(|| AttnError::InvalidArgument(format!("too many work items ({blocks} x {batch})")))?;
    if items == 0 {
        return Err(AttnError::InvalidArgument("a forward launch with no rows".into()));
    }
    params.work_batch = i32::try_from(batch).map_err(|_| AttnError::InvalidArgument("batch too large".into()))?;
    params.work_items = i64::from(items);
    Ok((params, (items, 1, 1)))
}

/// The fused table of `group` (at most [`MAX_FUSED`] parts) in a copy of the first part's
/// parameters, and the table's blocks (grid x indices) of one batch element.
fn fuse_table(group: &[FusePart]) -> Result<(AttnParams, usize)> {
    let first = group.first().ok_or_else(|| AttnError::InvalidArgument("a forward launch with no rows".into()))?;
    if group.len() > MAX_FUSED {
        return Err(AttnError::InvalidArgument(format!(
            "{} patterns in one launch (at most {MAX_FUSED})",
            group.len()
        )));
    }
    let mut params = first.params;
    params.fused = group.len() as i32;
    let mut next = 0usize;
    for (slot, part) in params.fuse.iter_mut().zip(group) {
        let p = &part.params;
        *slot = FusedPattern {
            first: next as i64,
            blocks: part.blocks as i64,
            head0: p.head0,
            w: p.w,
            r: p.r,
            fixed_off: p.fixed_off,
            band_left: p.band_left,
            band_right: p.band_right,
        };
        next = part
            .blocks
            .checked_mul(part.heads)
            .and_then(|n| n.checked_add(next))
            .ok_or_else(|| AttnError::InvalidArgument("launch grid too large".into()))?;
    }
    Ok((params, next))
}
