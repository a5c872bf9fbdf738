//! The compute of one Ulysses rank once its slot's heads are here: each query head of
//! the slot attends the group's query rows onto one group's keys and values at a time
//! (every pattern of the head, on global positions, through the same block kernels as
//! the ring), LSE-merged forward and exact backward (dq accumulated, each block's dk/dv
//! returned), in f32.

use std::ops::Range;

use attn_core::{Element, HeadPatterns, Result};

use crate::compute::head_work::for_each_item;
use crate::compute::kernel_bridge::{GradRows, KeyBlock, Mask, Rows, attend_backward, attend_forward};
use crate::plan::RingProblem;
use crate::plan::heads_split::HeadSplit;

/// A rank's slot after the first all-to-all: the group's rows (`qpos`, ascending) of the
/// slot's query heads and of the key/value heads they read, one buffer (`rows * d`) per
/// (batch, local head), batch-major.
#[derive(Debug)]
pub(crate) struct SlotRows<T> {
    pub split: HeadSplit,
    /// This rank's slot.
    pub slot: usize,
    pub qpos: Vec<usize>,
    pub q: Vec<Vec<T>>,
    pub k: Vec<Vec<T>>,
    pub v: Vec<Vec<T>>,
    /// The backward's grad_out rows (like `q`; empty in the forward).
    pub go: Vec<Vec<T>>,
    /// The backward's gradient into the LSE, one value per query row (empty in the forward).
    pub glse: Vec<Vec<f32>>,
}

/// One group's keys and values of the slot: positions (ascending) and one buffer per
/// (batch, local key/value head).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyRows<'a, T> {
    pub pos: &'a [usize],
    pub k: &'a [Vec<T>],
    pub v: &'a [Vec<T>],
}

/// The slot's f32 forward: output (scaled by the head's `out_scale`) and lse per (batch, head).
#[derive(Debug)]
pub(crate) struct SlotForward {
    pub o: Vec<Vec<f32>>,
    pub lse: Vec<Vec<f32>>,
}

/// f32 dk and dv of one block of keys, like its `k` and `v`.
#[derive(Debug)]
pub(crate) struct KeyGrads {
    pub dk: Vec<Vec<f32>>,
    pub dv: Vec<Vec<f32>>,
}

impl KeyGrads {
    /// Zeros for `kbh` (batch, key/value head) buffers of `rows` rows.
    pub fn zeros(kbh: usize, rows: usize, d: usize) -> Self {
        KeyGrads { dk: vec![vec![0.0; rows * d]; kbh], dv: vec![vec![0.0; rows * d]; kbh] }
    }
}

/// The backward's per-row inputs: the final forward and `delta = grad_out . out - grad_lse`.
#[derive(Debug)]
pub(crate) struct SlotDelta {
    pub fwd: SlotForward,
    pub delta: Vec<Vec<f32>>,
}

impl<T: Element> SlotRows<T> {
    /// Query heads of the slot (global indices).
    pub fn heads(&self) -> Range<usize> {
        self.split.slot_heads(self.slot)
    }

    /// Key/value heads of the slot (global indices).
    pub fn kv_heads(&self) -> Range<usize> {
        self.split.slot_kv(self.slot)
    }

    /// The (batch, local key/value head) buffer that (batch `b`, local query head `hl`) reads.
    fn kv_of(&self, b: usize, hl: usize) -> usize {
        b * self.kv_heads().len() + self.split.local_kv(self.slot, self.heads().start + hl)
    }

    /// The mask of pattern `pat` for batch row `b` and this slot's local query head `hl`.
    fn mask<'p>(&self, problem: &'p RingProblem, pat: attn_core::SegmentPattern, b: usize, hl: usize) -> Mask<'p> {
        Mask {
            pat,
            band: problem.cfg.band(),
            scale: problem.cfg.scale_for(problem.head_dim) as f32,
            d: problem.head_dim,
            key_padding: problem.padding_row(b),
            packing: problem.masks.view().packing,
            blocks: problem.block_row(b, self.heads().start + hl),
        }
    }

    /// The group's own keys and values.
    pub fn own_keys(&self) -> KeyRows<'_, T> {
        KeyRows { pos: &self.qpos, k: &self.k, v: &self.v }
    }

    /// Every query head's patterns, for the slot's heads.
    fn patterns(&self, problem: &RingProblem) -> Vec<HeadPatterns> {
        self.heads().map(|h| problem.cfg.head_patterns(problem.heads, h)).collect()
    }

    /// Empty accumulators: zero output, lse of minus infinity.
    pub fn forward_start(&self, problem: &RingProblem) -> SlotForward {
        let (nq, d, bm) = (self.qpos.len(), problem.head_dim, problem.batch * self.heads().len());
        SlotForward { o: vec![vec![0.0f32; nq * d]; bm], lse: vec![vec![f32::NEG_INFINITY; nq]; bm] }
    }

    /// Merge the attention of every (batch, head) of the slot onto `keys` into `acc`, split
    /// over `threads`.
    pub fn attend(
        &self,
        problem: &RingProblem,
        keys: KeyRows<'_, T>,
        acc: &mut SlotForward,
        threads: usize,
    ) -> Result<()> {
        let (d, m) = (problem.head_dim, self.heads().len());
        let hps = self.patterns(problem);
        let items: Vec<_> = acc.o.iter_mut().zip(acc.lse.iter_mut()).enumerate().collect();
        for_each_item(threads, items, |(bh, (o, lse))| {
            let (b, hl) = (bh / m, bh % m);
            let q = Rows { pos: &self.qpos, data: &self.q[bh], stride: d };
            let kbh = self.kv_of(b, hl);
            let block = KeyBlock { pos: keys.pos, k: &keys.k[kbh], v: &keys.v[kbh], stride: d };
            for &(_, pat) in &hps[hl].patterns {
                attend_forward(q, block, self.mask(problem, pat, b, hl), o, lse)?;
            }
            Ok(())
        })
    }

    /// Scale the merged output by each head's `out_scale`: the final forward.
    pub fn forward_finish(&self, problem: &RingProblem, acc: &mut SlotForward) {
        let m = self.heads().len();
        let hps = self.patterns(problem);
        for (bh, o) in acc.o.iter_mut().enumerate() {
            let scale = hps[bh % m].out_scale as f32;
            o.iter_mut().for_each(|x| *x *= scale);
        }
    }

    /// `delta = grad_out . out - grad_lse` per query row (the LSE's gradient only on rows
    /// that attend something).
    pub fn delta(&self, problem: &RingProblem, fwd: SlotForward) -> SlotDelta {
        let (d, nq) = (problem.head_dim, self.qpos.len());
        let delta = (0..fwd.o.len())
            .map(|bh| {
                (0..nq)
                    .map(|i| {
                        let go = &self.go[bh][i * d..(i + 1) * d];
                        let dot: f32 = go.iter().zip(&fwd.o[bh][i * d..(i + 1) * d]).map(|(x, y)| x.to_f32() * y).sum();
                        match self.glse.get(bh) {
                            Some(g) if fwd.lse[bh][i].is_finite() => dot - g[i],
                            _ => dot,
                        }
                    })
                    .collect()
            })
            .collect();
        SlotDelta { fwd, delta }
    }

    /// Add the share of `keys` in the gradients: dq (like `q`) in place, and into `kg` the
    /// block's dk/dv; work split by (batch, key/value head) over `threads`.
    pub fn attend_backward(
        &self,
        problem: &RingProblem,
        sd: &SlotDelta,
        keys: KeyRows<'_, T>,
        dq: &mut [Vec<f32>],
        kg: &mut KeyGrads,
        threads: usize,
    ) -> Result<()> {
        let d = problem.head_dim;
        let (m, mk) = (self.heads().len(), self.kv_heads().len());
        let hps = self.patterns(problem);
        // Each (batch, key/value head) with the dq of the query heads reading it.
        let mut readers: Vec<Vec<(usize, &mut Vec<f32>)>> = (0..problem.batch * mk).map(|_| Vec::new()).collect();
        for (bh, dq) in dq.iter_mut().enumerate() {
            readers[self.kv_of(bh / m, bh % m)].push((bh, dq));
        }
        let items: Vec<_> = kg.dk.iter_mut().zip(kg.dv.iter_mut()).zip(readers).enumerate().collect();
        for_each_item(threads, items, |(kbh, ((dk, dv), readers))| {
            let block = KeyBlock { pos: keys.pos, k: &keys.k[kbh], v: &keys.v[kbh], stride: d };
            for (bh, dq) in readers {
                let (b, hl) = (bh / m, bh % m);
                let q = Rows { pos: &self.qpos, data: &self.q[bh], stride: d };
                let gr = GradRows {
                    lse: &sd.fwd.lse[bh],
                    go: &self.go[bh],
                    go_stride: d,
                    go_scale: hps[hl].out_scale as f32,
                    delta: &sd.delta[bh],
                };
                for &(_, pat) in &hps[hl].patterns {
                    attend_backward(q, block, self.mask(problem, pat, b, hl), gr, dq, dk, dv)?;
                }
            }
            Ok(())
        })
    }
}
