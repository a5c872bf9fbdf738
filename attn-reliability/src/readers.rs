//! Which outputs read an input row, from the pattern math alone: the ground truth for
//! "a NaN in one input row reaches only the outputs that read it".

use std::collections::BTreeSet;

use attn_core::DilatedConfig;

/// Query positions whose head-`head` output reads key/value position `kv_pos` (the
/// union over the head's patterns of `attends(i, kv_pos, causal)`), for `seq` queries.
pub fn queries_reading_key(
    cfg: &DilatedConfig,
    heads: usize,
    head: usize,
    seq: usize,
    kv_pos: usize,
) -> BTreeSet<usize> {
    let hp = cfg.head_patterns(heads, head);
    (0..seq).filter(|&i| hp.patterns.iter().any(|(_, p)| p.attends(i, kv_pos, cfg.causality()))).collect()
}

/// Whether head `head` at query position `pos` has at least one key (some pattern of the
/// head selects it; a selected query always attends itself).
pub fn has_keys(cfg: &DilatedConfig, heads: usize, head: usize, pos: usize, kv_len: usize) -> bool {
    let hp = cfg.head_patterns(heads, head);
    hp.patterns.iter().any(|(_, p)| p.keys_of(pos, kv_len, cfg.causality()).next().is_some())
}

/// Flat row index `(b * seq + s) * heads + h` of a `[batch, seq, heads, _]` tensor.
pub fn row_index(seq: usize, heads: usize, b: usize, s: usize, h: usize) -> usize {
    (b * seq + s) * heads + h
}
