//! The compute of one Ulysses rank once its slot's heads are here: each query head of
//! the slot attends the group's query rows onto the whole sequence's keys and values
//! (every pattern of the head, on global positions, through the same block kernels as
//! the ring), forward and exact backward, in f32.

use std::ops::Range;

use attn_core::{Element, HeadPatterns, Result};

use crate::compute::head_work::for_each_item;
use crate::compute::kernel_bridge::{GradRows, KeyBlock, Mask, Rows, attend_backward, attend_forward};
use crate::plan::RingProblem;
use crate::plan::heads_split::HeadSplit;

/// A rank's slot after the exchanges: query rows of the group (`qpos`, ascending) and
/// keys and values over every position `0..seq`, one buffer (`rows * d`) per (batch,
/// local head), batch-major.
#[derive(Debug)]
pub(crate) struct SlotRows<T> {
    pub split: HeadSplit,
    /// This rank's slot.
    pub slot: usize,
    pub qpos: Vec<usize>,
    pub kpos: Vec<usize>,
    pub q: Vec<Vec<T>>,
    pub k: Vec<Vec<T>>,
    pub v: Vec<Vec<T>>,
    /// The backward's grad_out rows (like `q`; empty in the forward).
    pub go: Vec<Vec<T>>,
    /// The backward's gradient into the LSE, one value per query row (empty when none).
    pub glse: Vec<Vec<f32>>,
}

/// The slot's f32 forward: output (scaled by the head's `out_scale`) and lse per (batch, head).
#[derive(Debug)]
pub(crate) struct SlotForward {
    pub o: Vec<Vec<f32>>,
    pub lse: Vec<Vec<f32>>,
}

/// The slot's f32 gradients: dq like `q`, dk and dv like `k` and `v`.
#[derive(Debug)]
pub(crate) struct SlotGrads {
    pub dq: Vec<Vec<f32>>,
    pub dk: Vec<Vec<f32>>,
    pub dv: Vec<Vec<f32>>,
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

    fn mask<'p>(&self, problem: &'p RingProblem, pat: attn_core::SegmentPattern, b: usize) -> Mask<'p> {
        Mask {
            pat,
            band: problem.cfg.band(),
            scale: problem.cfg.scale_for(problem.head_dim) as f32,
            d: problem.head_dim,
            key_padding: problem.padding_row(b),
            packing: problem.masks.view().packing,
        }
    }

    fn keys(&self, kbh: usize, d: usize) -> KeyBlock<'_, T> {
        KeyBlock { pos: &self.kpos, k: &self.k[kbh], v: &self.v[kbh], stride: d }
    }

    /// Every query head's patterns, for the slot's heads.
    fn patterns(&self, problem: &RingProblem) -> Vec<HeadPatterns> {
        self.heads().map(|h| problem.cfg.head_patterns(problem.heads, h)).collect()
    }

    /// The forward of every (batch, head) of the slot, split over `threads`.
    pub fn forward(&self, problem: &RingProblem, threads: usize) -> Result<SlotForward> {
        let (d, nq, m) = (problem.head_dim, self.qpos.len(), self.heads().len());
        let hps = self.patterns(problem);
        let mut o = vec![vec![0.0f32; nq * d]; problem.batch * m];
        let mut lse = vec![vec![f32::NEG_INFINITY; nq]; problem.batch * m];
        let items: Vec<_> = o.iter_mut().zip(lse.iter_mut()).enumerate().collect();
        for_each_item(threads, items, |(bh, (o, lse))| {
            let (b, hl) = (bh / m, bh % m);
            let q = Rows { pos: &self.qpos, data: &self.q[bh], stride: d };
            for &(_, pat) in &hps[hl].patterns {
                attend_forward(q, self.keys(self.kv_of(b, hl), d), self.mask(problem, pat, b), o, lse)?;
            }
            let scale = hps[hl].out_scale as f32;
            o.iter_mut().for_each(|x| *x *= scale);
            Ok(())
        })?;
        Ok(SlotForward { o, lse })
    }

    /// The gradients from the forward `fwd`: `delta = grad_out . out - grad_lse` (the
    /// LSE's gradient only on rows that attend something), then every pattern's share;
    /// work split by (batch, key/value head) over `threads`.
    pub fn backward(&self, problem: &RingProblem, fwd: &SlotForward, threads: usize) -> Result<SlotGrads> {
        let (d, nq, nk) = (problem.head_dim, self.qpos.len(), self.kpos.len());
        let (m, mk) = (self.heads().len(), self.kv_heads().len());
        let hps = self.patterns(problem);
        let delta: Vec<Vec<f32>> = (0..problem.batch * m)
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
        let mut dq = vec![vec![0.0f32; nq * d]; problem.batch * m];
        let mut dk = vec![vec![0.0f32; nk * d]; problem.batch * mk];
        let mut dv = vec![vec![0.0f32; nk * d]; problem.batch * mk];
        // Each (batch, key/value head) with the dq of the query heads reading it.
        let mut readers: Vec<Vec<(usize, &mut Vec<f32>)>> = (0..problem.batch * mk).map(|_| Vec::new()).collect();
        for (bh, dq) in dq.iter_mut().enumerate() {
            readers[self.kv_of(bh / m, bh % m)].push((bh, dq));
        }
        let items: Vec<_> = dk.iter_mut().zip(dv.iter_mut()).zip(readers).enumerate().collect();
        for_each_item(threads, items, |(kbh, ((dk, dv), readers))| {
            for (bh, dq) in readers {
                let (b, hl) = (bh / m, bh % m);
                let q = Rows { pos: &self.qpos, data: &self.q[bh], stride: d };
                let gr = GradRows {
                    lse: &fwd.lse[bh],
                    go: &self.go[bh],
                    go_stride: d,
                    go_scale: hps[hl].out_scale as f32,
                    delta: &delta[bh],
                };
                for &(_, pat) in &hps[hl].patterns {
                    attend_backward(q, self.keys(kbh, d), self.mask(problem, pat, b), gr, dq, dk, dv)?;
                }
            }
            Ok(())
        })?;
        Ok(SlotGrads { dq, dk, dv })
    }
}
